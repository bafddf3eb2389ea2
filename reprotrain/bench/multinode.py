"""The figures of docs/multinode.md, side by side in one run: two torchrun agents training the
real stage on loopback and in two network namespaces (alternating, ROUNDS each), then one agent
SIGKILLed. Root only (network namespaces).

    .venv/bin/python -m reprotrain.bench.multinode [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from reprotrain.bench.netns import (
    HEAD,
    OTHER,
    Node,
    digits_data,
    kill_the_other_agent,
    metrics,
    netns_available,
    network_namespaces,
    train_on,
    workspace,
)


def main(rounds: int) -> None:
    why = netns_available()
    if why:
        sys.exit(f"reprotrain.bench.multinode {why}")
    torch.set_num_threads(1)
    data = digits_data()
    tmp = Path(tempfile.mkdtemp(prefix="multinode-"))
    mlflow_uri = f"sqlite:///{tmp / 'mlflow.db'}"
    times: dict[str, list[float]] = {"loopback": [], "netns": []}
    accs: dict[str, set[float]] = {"loopback": set(), "netns": set()}
    with network_namespaces() as (head_ns, other_ns):
        for i in range(rounds):
            for kind in times:
                base = tmp / f"{kind}{i}"
                if kind == "loopback":
                    nodes = [Node(workspace(base / "a", data, 4), "127.0.0.1", None),
                             Node(workspace(base / "b", data, 4), "127.0.0.2", None)]
                else:
                    nodes = [Node(workspace(base / "a", data, 4), HEAD, head_ns),
                             Node(workspace(base / "b", data, 4), OTHER, other_ns)]
                _, seconds = train_on(nodes, mlflow_uri)
                times[kind].append(seconds)
                accs[kind].add(metrics(nodes[0])["best_val_acc"])
        kills = []
        for i in range(rounds):
            base = tmp / f"kill{i}"
            code, error_s, exited_s, _ = kill_the_other_agent(
                Node(workspace(base / "a", data, 8), HEAD, head_ns),
                Node(workspace(base / "b", data, 8), OTHER, other_ns), mlflow_uri)
            kills.append((code, error_s, exited_s))
    loop, netns = statistics.median(times["loopback"]), statistics.median(times["netns"])
    print("| run (epochs=4, 1 CPU process per agent) | median wall s | runs | best_val_acc |")
    print("|---|---|---|---|")
    print(f"| 2 agents, loopback | {loop:.1f} | {rounds} | {sorted(accs['loopback'])} |")
    print(f"| 2 agents, 2 network namespaces | {netns:.1f} | {rounds} | {sorted(accs['netns'])} |")
    print(f"| ratio netns / loopback | {netns / loop:.2f} | | |")
    print()
    print("| one agent SIGKILLed | exit code | error line after s | agent exit after s |")
    print("|---|---|---|---|")
    for code, error_s, exited_s in kills:
        print(f"| other machine's agent | {code} | {error_s:.2f} | {exited_s:.2f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
