"""python -m reprotrain.bench.gpu_check (`make gpu-check`): what only a GPU can show, in one run that
fits a short loan: tests/experiment/test_gpu.py, then the bench rows, each step under a time limit of its
own, everything in one folder (gpu-check/) even when a step fails, and summary.md, one screen:
the tests passed and failed, and a table labelled with the GPU's name.

GPU_CHECK_DRY=1 runs the same steps on the CPU at tiny sizes (the streamed decode's CPU tests in
place of tests/experiment/test_gpu.py), to show the run is whole and what its steps cost."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

# Dense bf16 peaks (TFLOP/s, from NVIDIA's data sheets), by a part of the device's name.
BF16_PEAK = {"H200": 989, "H100 PCIe": 756, "H100": 989, "B200": 2250, "A100": 312,
             "L40S": 362, "L4": 121, "A10G": 70, "A10": 125, "RTX 4090": 165}
# The whole run must fit 8 minutes: the tests' share, then the bench's.
TESTS_S, BENCH_S = 300, 150
CPU_TESTS = ["tests/experiment/test_cuda_path.py", "-k", "refuses_is_cropped or progressive_jpegs"]


def main() -> None:
    dry = os.environ.get("GPU_CHECK_DRY") == "1"
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu-check: no CUDA device on this machine (GPU_CHECK_DRY=1 runs its steps on "
                 "the CPU at tiny sizes)")
    out = Path(os.environ.get("GPU_CHECK_OUT", "gpu-check"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    steps = {"tests": tests(out, dry)}
    steps["bench"] = step(out, "bench", [sys.executable, "-m", "reprotrain.bench.gpu_check",
                                         "--bench"], BENCH_S)
    steps["total"] = {"seconds": round(time.monotonic() - start, 1)}
    summary = render(out, steps, dry)
    (out / "summary.md").write_text(summary)
    print(summary)
    failed = steps["tests"]["rc"] != 0 or steps["bench"]["rc"] != 0
    sys.exit(1 if failed else 0)


def step(out: Path, name: str, cmd: list[str], limit_s: int) -> dict:
    """cmd, its output in out/<name>.txt, stopped after limit_s."""
    t = time.monotonic()
    with open(out / f"{name}.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s,
                                env={**os.environ, "GPU_CHECK_OUT": str(out)}).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {limit_s} s"
    return {"rc": rc, "seconds": round(time.monotonic() - t, 1)}


def tests(out: Path, dry: bool) -> dict:
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)
    target = CPU_TESTS if dry else ["tests/experiment/test_gpu.py"]
    done = step(out, "tests", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v",
                               "-rs", f"--junitxml={junit}", *target], TESTS_S)
    done["cases"] = []
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            state = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")),
                         "passed")
            done["cases"].append((case.get("name"), state, float(case.get("time", 0))))
    return done


def render(out: Path, steps: dict, dry: bool) -> str:
    cases = steps["tests"]["cases"]
    count = {s: sum(1 for _, st, _ in cases if st == s) for s in ("passed", "failure", "error",
                                                                 "skipped")}
    bench = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
    lines = [f"# gpu-check on {bench.get('device', '?')}{' (dry run, CPU)' if dry else ''}", "",
             f"tests: {count['passed']} passed, {count['failure'] + count['error']} failed, "
             f"{count['skipped']} skipped ({steps['tests']['seconds']} s, rc "
             f"{steps['tests']['rc']})"]
    lines += [f"- {'FAILED' if st in ('failure', 'error') else st} {name} ({t:.0f} s)"
              for name, st, t in cases]
    if (tolerance := out / "decode-tolerance.json").exists():
        lines.append(f"GPU vs CPU decode: {json.dumps(json.loads(tolerance.read_text()))}")
    lines += ["", f"| {bench.get('device', '?')} | samples/s | note |", "|---|---|---|"]
    lines += [f"| {row['name']} | {row['samples_per_s']:,.4g} | {row.get('note', '')} |"
              for row in bench.get("rows", [])]
    lines += ["", f"steps: tests {steps['tests']['seconds']} s, bench {steps['bench']['seconds']} s "
              f"(rc {steps['bench']['rc']}), total {steps['total']['seconds']} s; logs in {out}/"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the bench rows


def bench(out: Path, dry: bool) -> None:
    device = torch.device("cpu" if dry else "cuda")
    name = "CPU" if dry else torch.cuda.get_device_name(device)
    rows = [device_loop(device, dry), *stream_rows(device, dry), resnet18(device, name, dry)]
    (out / "bench.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))


def device_loop(device: torch.device, dry: bool) -> dict:
    """The repo's optimized loop (params.yaml's train section) on the device loader, CIFAR-sized
    noise: the second of two epochs."""
    from reprotrain.bench.training import datasets, run_row
    from stages.config import load_params
    from stages.models import build_model

    params = load_params()
    n, size = (128, 16) if dry else (16384, 32)
    data = datasets(["cifar"], n, size, params.seed, params.data)["cifar"]
    torch.manual_seed(params.seed)
    model = build_model(dataclasses.replace(params.model, width=8 if dry else 64), 3, 10, size)
    cfg = dataclasses.replace(params.train, loader="device", device=device.type,
                              **{"precision": "fp32"} if dry else {})
    got = run_row(model, data, cfg, 64 if dry else 512, params.lr, params.seed)
    return {"name": "optimized loop, device loader", "samples_per_s": got["samples_per_s"],
            "note": f"{n} samples at {size} px, batch {64 if dry else 512}"}


def stream_rows(device: torch.device, dry: bool) -> list[dict]:
    """The stream loader over noise JPEGs in shards, decoded by nvJPEG on the device and by
    Pillow in the workers: batches a second, the second epoch."""
    import numpy as np
    from PIL import Image

    from stages.batches import loader_batches, plan_batches
    from stages.data import Split
    from stages.lib.images import Files
    from stages.lib.shards import ShardImages, write_split

    n, side, size, bs, workers = (96, 32, 16, 32, 2) if dry else (4096, 256, 224, 256, 8)
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        paths = [f"{tmp}/{i}.jpg" for i in range(n)]
        for path in paths:
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
        write_split(Path(tmp, "split"), Files.of(paths, 0), 3, size, "squash", side, 2**27,
                    os.cpu_count() or 1)
        x = ShardImages(Path(tmp, "split"), 3, size, "squash")
        split = Split(x, x.labels())
        rows = []
        decoders = [("GPU decode (nvJPEG)", device), ("CPU decode (Pillow, workers)",
                                                       torch.device("cpu"))]
        for label, where in decoders[1:] if dry else decoders:
            batches = loader_batches(split, plan_batches(n, bs, 1, 1), where, 0, True, 0, 1,
                                     workers, streamed=True)
            for epoch in range(2):
                t = time.perf_counter()
                for xb, *_ in batches(epoch):
                    xb = xb.to(device, non_blocking=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t
            rows.append({"name": f"stream loader, {label}", "samples_per_s": n / seconds,
                         "note": f"{n} JPEGs of {side} px to {size} px, batch {bs}, "
                                 f"{workers} workers"})
    return rows


def resnet18(device: torch.device, name: str, dry: bool) -> dict:
    """torchvision's resnet18 training steps at 224 px (dry: 64) in bf16 with channels_last:
    samples a second, and FLOP/s (counted by torch's FlopCounterMode) as a share of the bf16
    peak."""
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    bs, size, steps = (2, 32, 1) if dry else (256, 224, 30)
    label = f"resnet18 {size} px {'fp32' if dry else 'bf16'} channels_last"
    model = torchvision.models.resnet18(num_classes=1000).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(bs, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (bs,), device=device)

    def train_step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=not dry):  # CPUs emulate it
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        train_step()
    for _ in range(0 if dry else 3):  # warm-up: cudnn's choices, the allocator
        train_step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        train_step()
    sync()
    seconds = (time.perf_counter() - t) / steps
    flops = counter.get_total_flops() / seconds
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    share = f", {flops / (peak * 1e12):.0%} of {peak} TFLOP/s bf16 peak" if peak else ""
    return {"name": label, "samples_per_s": bs / seconds,
            "note": f"batch {bs}: {flops / 1e12:.3g} TFLOP/s{share}"}


if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench(Path(os.environ.get("GPU_CHECK_OUT", "gpu-check")),
              os.environ.get("GPU_CHECK_DRY") == "1")
    else:
        main()
