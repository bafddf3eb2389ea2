"""`make verify`'s verdict: `python -m reprotrain.team.verify OLD_LOCK` compares dvc.lock after a forced
rerun of every stage with OLD_LOCK, the one before it; names the outputs whose hashes changed
and how to get the previous ones back.

`python -m reprotrain.team.verify --here` (the last step of `make repro`): one line when
the trained model in the workspace was made on another CPU, thread count or GPU than this
machine trains with. DVC cannot say it: its run-cache restores outputs made under any thread
count, since what is not a dependency cannot split its key, and a teammate's cache should
restore (`make share`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

from stages.lib.cli import run_stage
from stages.lib.errors import UserError


class NotReproduced(UserError):
    """A rerun gave other bytes; the message names the outputs and how to get back."""


def output_hashes(lock: str) -> dict[str, str]:
    stages = YAML(typ="safe").load(lock).get("stages", {})
    return {out["path"]: out.get("md5", "") for stage in stages.values()
            for out in stage.get("outs", [])}


def git(*args: str) -> str | None:
    p = subprocess.run(["git", *args], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else None


def printable(value: object) -> str:
    return "".join(c if c.isprintable() else "?" for c in str(value))


def made_elsewhere(made_on_file: Path = Path("models/train/made_on.json")) -> str | None:
    try:
        then = json.loads(made_on_file.read_text()) if made_on_file.is_file() else None
    except (OSError, ValueError):
        then = None
    if not isinstance(then, dict) or not (then.get("gpu") or then.get("cpu")):
        return None  # not trained yet, by a version that did not record it, or no record
    from stages.config import load_params
    from stages.distributed import requested_processes
    from stages.runtime import cpu_has_bf16, cpu_name, made_on, resolve_device

    def machine(m: dict) -> str:
        if m.get("gpu"):
            return printable(m["gpu"])
        text = printable(m.get("cpu"))
        if "bf16" in m:
            text += " (bf16)" if m["bf16"] else " (no bf16: fp32)"
        if m.get("threads") is not None:
            text += f" with {m['threads']} thread{'s' if m['threads'] != 1 else ''}"
        return text + (f" in each of {m['processes']} processes" if m.get("processes") else "")

    where = f"note: {made_on_file.parent}/ was made on {machine(then)} ({made_on_file.name})"
    try:
        params = load_params()
        processes = requested_processes(params.train, params.batch_size)
        # Under torchrun each process's threads are torchrun's to set: compared no further.
        here = made_on(resolve_device(params.train.device)) if processes == 1 else \
            {"cpu": cpu_name(), "bf16": cpu_has_bf16(), "processes": processes}
    except UserError as e:
        return f"{where}; it could not be trained again here: {e}"
    if "processes" in here or "processes" in then:
        then = {k: v for k, v in then.items() if k != "threads"}
    if then == here:
        return None
    return (f"{where}, here training runs on {machine(here)}: a rerun gives other last bits "
            "(`make verify` would name them). DVC restores outputs made on any machine "
            "from its run-cache; `dvc repro -f train` remakes them here")


def main() -> None:
    if sys.argv[1:] == ["--here"]:
        try:
            note = made_elsewhere()
        except Exception as e:  # noqa: BLE001 - advice only: it never fails `make repro`
            note = f"note: could not compare where models/train/ was made ({type(e).__name__})"
        if note:
            print(note)
        return
    old_lock = Path(sys.argv[1])
    before, after = output_hashes(old_lock.read_text()), output_hashes(Path("dvc.lock").read_text())
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if not changed:
        print("verified: every output is byte-identical to what dvc.lock recorded")
        return
    # The outputs DVC caches come back with `dvc checkout`; the `cache: false` ones (metrics,
    # plots) are in git only, so their previous versions are the committed ones.
    in_git = (git("ls-files", "--", *changed) or "").split()
    if git("show", "HEAD:dvc.lock") == old_lock.read_text():
        back = f"git checkout -- {' '.join(['dvc.lock', *in_git])} && dvc checkout"
    else:
        back = (f"cp {old_lock} dvc.lock && dvc checkout"
                + (f", and the committed {', '.join(in_git)} with `git checkout --`" if in_git else ""))
    raise NotReproduced(
        f"NOT reproduced: a rerun changed {', '.join(changed)}. Results are byte-identical only "
        "on the same CPU, thread count (OMP_NUM_THREADS) and requirements.lock; the rerun's "
        f"outputs are in place now, to get the previous ones back: {back}")


if __name__ == "__main__":
    run_stage(main)
