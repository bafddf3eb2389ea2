"""python -m reprotrain.bench.training: the loop-optimization table, measured side by side on this machine.

Every row but `plain` is the repo's own `train()` with some switches changed, on the same model,
the same initial weights, the same batch size and the same number of steps; `plain` is a
textbook PyTorch loop written out here, outside the repo's code. Rounds are interleaved
(A B C ... A B C ...) so that a noisy neighbour slows every row alike; each round trains two
epochs and times the second, so worker start-up and compilation stay out of the steady-state
figure (compilation is reported in its own column). One warm-up round is discarded.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from reprotrain.bench import cpu_label
from stages.config import PREPARED, DataConfig, TrainConfig, load_params
from stages.data import Split, load_meta, load_split, normalize
from stages.lib.cli import ArgumentParser, positive_int
from stages.lib.files import atomic_write, write_json, write_text
from stages.loop import Job, RunIO, train
from stages.models import build_model
from stages.runtime import (
    peak_mem_mb,
    proc_status_mb,
    reset_peak_mem,
    resolve_device,
    resolve_precision,
)
from stages.sources import build_meta, load_digits, resize, stratified_split

# The article's rows. `standard` is a textbook loop: DataLoader in the main process, fp32,
# NCHW, a .item() sync every step, no clipping.
STANDARD = dict(loader="dataloader", num_workers=0, precision="fp32", channels_last=False,
                compile=False, log_every=1, clip_grad_norm=0.0, accumulate=1, ema=False)
ROWS: dict[str, tuple[dict, int]] = {  # name: (train overrides, batch-size multiplier)
    "standard": (STANDARD, 1),
    "plain": ({}, 1),  # not train(): `plain_row`, the loop a user would write without this repo
    "grad_accum": ({**STANDARD, "accumulate": 4}, 1),
    "amp": ({**STANDARD, "precision": "auto"}, 1),
    "pinned_workers": ({**STANDARD, "num_workers": "auto"}, 1),
    "optimized": ({}, 1),  # the repo's default fast path: params.yaml's train section
    "optimized_batch4x": ({}, 4),
    "optimized_compile": ({"compile": True}, 1),
    # What `optimized` is on a CPU without bf16 (auto precision is fp32 there), and whether
    # channels_last still pays without bf16's AMX kernels; measurable on any CPU.
    "optimized_fp32": ({"precision": "fp32"}, 1),
    "optimized_fp32_nchw": ({"precision": "fp32", "channels_last": False}, 1),
}
QUICK_SKIPS = ("optimized_compile",)  # compiling takes 20-50 s on 2 CPU cores
DATASETS = ("digits", "cifar", "prepared")
# Rounds of one row further apart than this (max - min over median) mean the machine was busy
# with something else during the run: the report says so instead of printing a confident ratio.
NOISY_SPREAD = 0.25


def datasets(names: list[str], n: int, synthetic_size: int, seed: int,
             data_cfg: DataConfig) -> dict:
    """name -> (train, val, mean, std, channels, classes, about): digits, CIFAR-sized noise,
    data/prepared; `about` names prepared's data and the size of its train split."""
    out = {}
    g = torch.Generator().manual_seed(seed)
    if "digits" in names:
        x, y, _ = load_digits()
        x = resize(x, 16, 1)
        idx = torch.randint(len(y), (n,), generator=g)  # repeated to fill the step count
        parts = stratified_split(y, 0.1, 0.2, seed)
        tr = Split(x[idx], y[idx])
        val = Split(x[parts["val"]][:64], y[parts["val"]][:64])
        meta = build_meta({"train": tr, "val": val, "test": val}, [str(i) for i in range(10)],
                          dataclasses.replace(data_cfg, image_size=16, channels=1))
        out["digits"] = (tr, val, meta["mean"], meta["std"], 1, 10, None)
    if "prepared" in names:  # the train stage's own data: `dvc repro prepare` first
        meta = load_meta(PREPARED)
        tr, val = load_split(PREPARED, "train"), load_split(PREPARED, "val")
        idx = torch.arange(n) % len(tr.y)
        about = {"source": meta["source"], "train_images": len(tr.y),
                 "shape": "x".join(map(str, tr.x.shape[1:]))}
        out["prepared"] = (Split(tr.x[idx], tr.y[idx]), val, meta["mean"], meta["std"],
                           meta["channels"], len(meta["classes"]), about)
    if "cifar" in names:
        s = synthetic_size
        x = torch.randint(0, 256, (n + 64, 3, s, s), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n + 64,), generator=g)
        out["cifar"] = (Split(x[:n], y[:n]), Split(x[n:], y[n:]), [0.5] * 3, [0.25] * 3, 3, 10, None)
    return out


def run_row(model, data, cfg: TrainConfig, batch_size: int, lr: float, seed: int) -> dict:
    tr, val, mean, std = data[:4]
    device = resolve_device(cfg.device)
    # On the CPU the row's figure is its peak resident memory above the level before it. glibc
    # keeps freed memory for reuse, which would count the previous row's peak as this row's
    # starting level: malloc_trim hands it back to the OS first.
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the base is then higher
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = proc_status_mb("VmRSS") if reset_peak_mem(device) else None
    result = train(model, Job(train=tr, val=val, mean=mean, std=std, cfg=cfg, lr=lr, epochs=2,
                              batch_size=batch_size, seed=seed),
                   RunIO(progress=False, verbose=False))
    first, second = result.history
    # train() restarts the peak every epoch: this is the timed second epoch's.
    peak = second["peak_mem_mb"]
    return {"samples_per_s": second["samples_per_s"],
            "train_s": len(tr.y) / second["samples_per_s"],
            "first_train_s": len(tr.y) / first["samples_per_s"],
            "peak_mem_mb": peak if device.type == "cuda" else
            None if base is None else peak - base}


def plain_row(model, data, cfg: TrainConfig, batch_size: int, lr: float, seed: int) -> dict:
    """The textbook loop, outside the repo's code: a shuffling DataLoader in the main process,
    fp32, NCHW, torch's default AdamW, a .item() every step; no augmentation, clipping or
    schedule, so it does less work per step than `standard`. Two epochs, the second timed."""
    from torch.utils.data import DataLoader, TensorDataset

    tr, _, mean, std = data[:4]
    device = resolve_device(cfg.device)
    model = model.to(device).train()
    mean_t, std_t = torch.tensor(mean, device=device), torch.tensor(std, device=device)
    loader = DataLoader(TensorDataset(tr.x, tr.y), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss()
    with contextlib.suppress(OSError, AttributeError):  # as in run_row
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = proc_status_mb("VmRSS")
    epochs = []
    for _ in range(2):
        has_peak = reset_peak_mem(device)
        t0, total = time.perf_counter(), 0.0
        for x, y in loader:
            x, y = normalize(x.to(device), mean_t, std_t), y.to(device)
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()  # the textbook's running loss: a sync every step
        epochs.append((time.perf_counter() - t0, peak_mem_mb(device) if has_peak else None))
    (first_s, _), (second_s, peak) = epochs
    return {"samples_per_s": len(tr.y) / second_s, "train_s": second_s, "first_train_s": first_s,
            "peak_mem_mb": peak if device.type == "cuda" or peak is None or base is None
            else peak - base}


def bench(rows: list[str], names: list[str], rounds: int, steps: int, batch_size: int,
          synthetic_size: int, cifar_width: int) -> dict:
    params = load_params()
    base_cfg = params.train
    device = resolve_device(base_cfg.device)
    n = steps * batch_size * max(ROWS[r][1] for r in rows)
    results, widths = [], {}
    for name, data in datasets(names, n, synthetic_size, params.seed, params.data).items():
        torch.manual_seed(params.seed)
        # The same initial weights in every row. CIFAR-sized images get a CIFAR-sized width.
        model_cfg = params.model if name != "cifar" else \
            dataclasses.replace(params.model, width=cifar_width)
        init = build_model(model_cfg, data[4], data[5], data[0].x.shape[-1])
        widths[name] = model_cfg.width
        samples: dict[str, list[dict]] = {r: [] for r in rows}
        warmup: dict[str, dict] = {}
        for round_ in range(rounds + 1):
            for row in rows:
                overrides, mult = ROWS[row]
                cfg = dataclasses.replace(base_cfg, **overrides)
                bs = batch_size * mult
                tr = Split(data[0].x[:steps * bs], data[0].y[:steps * bs])
                m = (plain_row if row == "plain" else run_row)(
                    copy.deepcopy(init), (tr, *data[1:]), cfg, bs, params.lr, params.seed)
                if round_:
                    samples[row].append(m)
                else:  # round 0 warms up caches, allocators, kernels and compiles: discarded
                    warmup[row] = m
                print(f"  {name} round {round_}/{rounds} {row}: {m['samples_per_s']:.0f} samples/s",
                      file=sys.stderr, flush=True)
        ref = statistics.median(m["samples_per_s"] for m in samples[rows[0]])
        for row in rows:
            ms = samples[row]
            sps = [m["samples_per_s"] for m in ms]
            compiled = row != "plain" and ROWS[row][0].get("compile", base_cfg.compile)
            results.append({
                "dataset": name, "name": row, "batch_size": batch_size * ROWS[row][1],
                "samples_per_s": statistics.median(sps), "about": data[6],
                # What a whole epoch of the train stage's split takes at this rate.
                "split_epoch_s": data[6]["train_images"] / statistics.median(sps)
                if data[6] else None,
                "epoch_s": statistics.median(m["train_s"] for m in ms),
                "peak_mem_mb": None if None in (mem := [m["peak_mem_mb"] for m in ms])
                else statistics.median(mem),
                "ratio": statistics.median(sps) / ref,
                "min_samples_per_s": min(sps), "max_samples_per_s": max(sps),
                "noisy": (max(sps) - min(sps)) / statistics.median(sps) > NOISY_SPREAD,
                # Compilation happens once, in the warm-up round's first epoch.
                "compile_s": warmup[row]["first_train_s"] - statistics.median(
                    m["train_s"] for m in ms) if compiled else None,
            })
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else cpu_label(),
        "precision_auto": resolve_precision("auto", device),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "settings": {"rounds": rounds, "steps": steps, "batch_size": batch_size,
                     "synthetic_size": synthetic_size, "datasets": names, "reference": rows[0],
                     "model": f"{params.model.arch}, width per dataset {widths}"},
        "memory": "CUDA max_memory_allocated" if device.type == "cuda"
        else "peak RSS of the main process in the timed epoch above its level before the row "
        "(the kernel's VmHWM, reset per epoch; DataLoader worker processes not included)",
        "rows": results,
    }


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Measured {report['date']} on {report['device']} ({report['device_name']}), "
             f"torch {report['torch']}, {report['threads']} threads; auto precision = "
             f"{report['precision_auto']}. {s['steps']} steps of batch {s['batch_size']} per epoch, "
             f"median of {s['rounds']} interleaved rounds (min..max shown). Model: {s['model']}. "
             f"Memory: {report['memory']}.", ""]
    ref = s.get("reference", "standard")
    for name in dict.fromkeys(r["dataset"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["dataset"] == name]
        about = rows[0].get("about")
        lines += [f"**{name}**" + (f" ({about['source']}, {about['shape']})" if about else ""), "",
                  f"| variant | epoch time | peak memory | samples/s | vs {ref} "
                  "| min..max samples/s | compile |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            comp = f"{r['compile_s']:.1f} s" if r["compile_s"] is not None else "-"
            mem = f"{r['peak_mem_mb']:.0f} MB" if r["peak_mem_mb"] is not None else "-"
            lines.append(f"| {r['name']} (batch {r['batch_size']}) | {r['epoch_s']:.2f} s | "
                         f"{mem} | {r['samples_per_s']:.0f} | "
                         f"{r['ratio']:.2f}x | {r['min_samples_per_s']:.0f}.."
                         f"{r['max_samples_per_s']:.0f} | {comp} |")
        if about:
            lines += ["", f"At these rates one epoch of its {about['train_images']} train images "
                      "takes " + ", ".join(f"{r['split_epoch_s']:.1f} s ({r['name']})"
                                           for r in rows) + " (training only, no validation)."]
        noisy = [r["name"] for r in rows if r["noisy"]]
        if noisy:
            lines += ["", f"Noisy: {', '.join(noisy)} varied by more than "
                      f"{NOISY_SPREAD:.0%} of the median between rounds, so something else was "
                      "using this machine; their ratios are uncertain. Rerun with more `--rounds`, "
                      "or on a quiet machine, before trusting them."]
        lines.append("")
    return "\n".join(lines)


def bar_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["dataset"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in report["rows"] if r["dataset"] == name]
        y = range(len(rows))
        med = [r["samples_per_s"] for r in rows]
        err = [[m - r["min_samples_per_s"] for m, r in zip(med, rows, strict=True)],
               [r["max_samples_per_s"] - m for m, r in zip(med, rows, strict=True)]]
        ax.barh(y, med, xerr=err, color="tab:blue", capsize=3)
        ax.set_yticks(y, [f"{r['name']} ({r['ratio']:.2f}x)" for r in rows])
        ax.invert_yaxis()
        ax.set(xlabel="samples/s (median, min..max)", title=f"{name} on {report['device']}")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m reprotrain.bench.training", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="few steps and rounds, no compile row: under a minute on 2 CPU cores")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    ap.add_argument("--datasets", default="digits,cifar",
                    help="digits, cifar (synthetic 32x32x3) and/or prepared (data/prepared: the "
                    "train stage's split of the current params, e.g. Fashion-MNIST)")
    ap.add_argument("--rounds", type=positive_int, default=None, help="measured rounds (default 5, quick 1)")
    ap.add_argument("--steps", type=positive_int, default=None, help="steps per epoch (default 20, quick 6)")
    ap.add_argument("--batch-size", type=positive_int, default=32)
    ap.add_argument("--synthetic-size", type=positive_int, default=32, help="side of the synthetic images")
    ap.add_argument("--cifar-width", type=positive_int, default=64, help="model.width on the synthetic set")
    ap.add_argument("--out", type=Path, default=Path("bench"), help="folder for report.md, chart.png")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--pipeline", action="store_true",
                    help="time the four stages instead, per part (start-up, tracking, loop, work)")
    ap.add_argument("--revs", default="HEAD",
                    help="with --pipeline: comma-separated git revisions, side by side")
    ap.add_argument("--server", action="store_true",
                    help="with --pipeline: each revision also tracked to `make server` (logins on)")
    args = ap.parse_args(argv)
    if args.pipeline:
        from reprotrain.bench import pipeline as bench_pipeline

        rounds = args.rounds or (1 if args.quick else 2)
        revs = [r for r in args.revs.split(",") if r]
        if args.server:
            from reprotrain.bench.sync import running_server

            with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp, \
                    running_server(Path(tmp)) as server:
                report = bench_pipeline.pipeline(revs, rounds, server)
        else:
            report = bench_pipeline.pipeline(revs, rounds)
        text = bench_pipeline.markdown(report, cpu_label(), rounds)
        print(text)
        write_text(args.out / "pipeline.md", text + "\n")
        write_json(args.out / "pipeline.json", {"cpu": cpu_label(), "rounds": rounds,
                                               "revisions": report})
        return

    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.quick:
        rows = [r for r in rows if r not in QUICK_SKIPS]
    names = [d for d in args.datasets.split(",") if d]
    if not set(names) <= set(DATASETS) or not names:
        ap.error(f"--datasets {args.datasets!r}: choose from {', '.join(DATASETS)}")
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (6 if args.quick else 20)

    report = bench(rows, names, rounds, steps, args.batch_size, args.synthetic_size,
                   args.cifar_width)
    text = markdown(report)
    print(text)
    write_text(args.out / "report.md", text + "\n")
    write_json(args.out / "results.json", report)
    bar_chart(report, args.out / "chart.png")
    if args.json:
        write_json(args.json, report)
    print(f"wrote {args.out / 'report.md'}, {args.out / 'chart.png'}, {args.out / 'results.json'}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
