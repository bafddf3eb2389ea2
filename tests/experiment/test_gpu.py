"""What only a GPU can show about the CUDA path: `make gpu-check` runs these on the first
machine with a GPU. Every test skips without CUDA."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from stages.checkpoints import latest_checkpoint
from stages.config import TrainConfig
from stages.data import load_split
from stages.optim import EMA, build_optimizer
from stages.runtime import resolve_precision
from tests.conftest import ROOT, copy_params
from tests.support.training import (
    InfGradOnce,
    cnn,
    fit,
    fit_ckpt,
    linear_model,
    same_weights,
    sgd_step,
    uninitialized_memory_is_nan,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = dict(device="cuda", loader="device")


def test_auto_precision_is_bf16_only_where_the_gpu_has_it_natively():
    cap = torch.cuda.get_device_capability()
    expected = "bf16" if cap[0] >= 8 else "fp16"  # T4 (7.5) and V100 (7.0) only emulate bf16
    assert resolve_precision("auto", torch.device("cuda")) == expected, (cap, expected)


def test_fused_sgd_on_cuda_with_fp16_scaling_survives_an_overflowed_first_step():
    cuda = torch.device("cuda")
    cfg = TrainConfig(optimizer="sgd", momentum=0.9, weight_decay=0.0)
    model = linear_model().to(cuda)
    opt = build_optimizer(model, cfg, 0.1, cuda)
    assert opt.defaults["fused"]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    x, y = torch.randn(8, 1, 16, 16, device=cuda), torch.arange(8, device=cuda) % 10
    with uninitialized_memory_is_nan(), torch.autocast("cuda", torch.float16):
        sgd_step(model, opt, scaler, x, y, blow_up=1e36)
    assert scaler.get_scale() == 2.0**15
    assert all(torch.count_nonzero(opt.state[p]["momentum_buffer"]) == 0
               for p in model.parameters())


def test_ema_update_never_waits_for_the_gpu():
    model = cnn().cuda()
    ema = EMA(model, 0.99)
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization raises
    try:
        for _ in range(3):
            ema.update(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert same_weights(ema.module, model)


def test_peak_memory_resets_before_anything_initialized_cuda():
    code = ("import torch; from stages.runtime import reset_peak_mem, peak_mem_mb; "
            "d = torch.device('cuda:0'); assert reset_peak_mem(d); print(peak_mem_mb(d))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_an_indexed_gpu_is_made_the_current_one():
    # Issue 56.5: `train.device: cuda:N` in one process never called set_device, and work that
    # names no device ran on GPU 0. The last GPU: with one, that CUDA is set up shows the call.
    last = torch.cuda.device_count() - 1
    code = ("import torch; from stages.runtime import resolve_device; "
            f"resolve_device('cuda:{last}'); "
            f"assert torch.cuda.is_initialized() and torch.cuda.current_device() == {last}")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("loader", ["device", "dataloader"])
def test_cuda_training_with_auto_precision_on_both_loaders(digits, loader):
    result = fit(cnn(), digits, epochs=2, precision="auto", device="cuda", loader=loader)
    assert result.device.startswith("cuda")
    assert result.history[-1]["val_acc"] > 0.5
    assert result.history[-1]["peak_mem_mb"] > 0


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fp16_training_skips_an_overflowed_step_and_logs_finite_norms(digits, optimizer):
    result = fit(InfGradOnce(cnn()), digits, epochs=2, precision="fp16", optimizer=optimizer,
                 **CUDA)
    assert all(math.isfinite(r["grad_norm"]) for r in result.history)
    assert result.history[-1]["val_acc"] > 0.5


def test_cuda_graphs_train_with_accumulation_and_validate(digits):
    # fp32: an output that is not copied would be the graph's own memory (bf16 casts copy).
    result = fit(cnn(), digits, epochs=2, compile="reduce-overhead", accumulate=2,
                 deterministic=False, precision="fp32", **CUDA)
    eager = fit(cnn(), digits, epochs=2, accumulate=2, deterministic=False, precision="fp32",
                **CUDA)
    assert result.history[-1]["val_acc"] > 0.5
    # Validation through graph replays gives the figures eager validation gives.
    assert abs(result.history[-1]["val_acc"] - eager.history[-1]["val_acc"]) < 0.05


def test_a_resumed_cuda_run_ends_bitwise_where_an_uninterrupted_one_does(digits, tmp_path):
    full = fit_ckpt(cnn(), digits, tmp_path / "full", epochs=3, **CUDA)
    part = tmp_path / "part"
    fit_ckpt(cnn(), digits, part, epochs=3, **CUDA)
    (part / "epoch-0003.pt").unlink()
    resumed = fit_ckpt(cnn(seed=9), digits, part, epochs=3, resume=latest_checkpoint(part), **CUDA)
    assert same_weights(full.model, resumed.model)


def test_two_short_cuda_runs_give_bitwise_identical_weights(digits):
    runs = [fit(cnn(), digits, epochs=2, precision="auto", **CUDA) for _ in range(2)]
    assert same_weights(runs[0].model, runs[1].model)


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory):
    """A folder of JPEGs (with a PNG and a CMYK JPEG, which the workers decode) as shards."""
    from PIL import Image

    from tests.conftest import env_with, run, set_params
    from tests.support.image_files import noise_folder
    from tests.support.workspaces import folder_workspace

    w = folder_workspace(tmp_path_factory.mktemp("jpeg") / "w")
    noise_folder(w / "raw", 20, side=96)
    Image.new("RGB", (80, 64), (200, 30, 30)).save(w / "raw/a/red.png")
    Image.new("CMYK", (64, 80), (0, 200, 0, 30)).save(w / "raw/b/cmyk.jpg")
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3",
                                   "data.image_size": "32"})
    run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT)))
    return w / "data/prepared"


# nvJPEG upsamples chroma by repeating samples, libjpeg-turbo (Pillow) by a smooth filter: on 4:2:0
# noise the two decodes differ by 12.6 levels a pixel on average, and after the crop and resize to
# 32 px by 3.8 a pixel over these images, 6.8 at most for one image (estimated on the CPU from the
# images' own chroma, both upsamplings, the same boxes and resize: docs/data.md). The bounds add
# half again for the IDCTs' rounding; each run writes what it measured to
# gpu-check/decode-tolerance.json (docs/data.md, "On a GPU, JPEGs decode there").
BATCH_MEAN, PER_IMAGE = 6.0, 10.0


def test_streamed_jpegs_decode_on_the_gpu_as_the_workers_would_crop_them(jpeg_shards):
    from stages.batches import EncodedStream, StreamedDataset
    from stages.lib.shards import COUNTS, decoded_batch, nvjpeg

    split = load_split(jpeg_shards, "train")
    crop = ((0.35, 1.0), (0.75, 4 / 3))
    enc, ref = EncodedStream(split, 3, crop), StreamedDataset(split, 3, crop)
    n = len(split.y)
    batch = EncodedStream.collate([enc[(i, 1)] for i in range(n)])
    boxes = batch[3]
    cuda = torch.device("cuda")
    before = COUNTS.device
    x = decoded_batch(*batch[:4], 32, 3, cuda, nvjpeg(cuda, 3), None)
    want = torch.stack([ref[(i, 1)][0] for i in range(n)]).cuda()
    jpeg = (boxes[:, 0] >= 0).cuda()
    assert x.is_cuda and 0 < int(jpeg.sum()) < n and COUNTS.device - before == int(jpeg.sum())
    assert torch.equal(x[~jpeg], want[~jpeg])
    diff = (x[jpeg].int() - want[jpeg].int()).abs().float()
    per_image = diff.mean(dim=(1, 2, 3))
    record("decode-tolerance", {"batch_mean": diff.mean().item(), "per_image_max":
                                per_image.max().item(), "bounds": [BATCH_MEAN, PER_IMAGE]})
    assert diff.mean() < BATCH_MEAN and per_image.max() < PER_IMAGE, per_image


def test_the_gpu_decode_waits_for_the_callers_queued_kernels(jpeg_shards):
    """pytorch/vision#9606's check: queue a long kernel, then reductions of tensors, free them
    while the reductions are queued, decode; a decode handed their blocks changes the sums."""
    from stages.lib.shards import nvjpeg

    split = load_split(jpeg_shards, "train")
    whole = torch.tensor([0.0, 0.0, 1.0, 1.0])
    payloads = [torch.frombuffer(bytearray(split.x.raw(i)), dtype=torch.uint8)
                for i in range(len(split.y)) if split.x.jpeg_crop(i, whole) is not None]
    cuda = torch.device("cuda")
    decode = nvjpeg(cuda, 3)
    want_images = [img.clone() for img in decode(payloads)]
    torch.cuda.synchronize()
    big = torch.randn(4096, 4096, device=cuda)
    wrong = 0
    for _ in range(20):
        victims = [torch.ones(img.numel(), dtype=torch.uint8, device=cuda)
                   for img in want_images * 4]
        torch.cuda.synchronize()
        for _ in range(20):  # a long kernel queue (~0.1 s) ahead of the sums
            big = (big @ big).clamp_(-1, 1)
        sums = [v.sum() for v in victims]
        del victims  # freed while their sums are still queued
        images = decode(payloads)
        torch.cuda.synchronize()
        wrong += sum(int(s) != img.numel() for s, img in zip(sums, want_images * 4, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(images, want_images, strict=True))
    assert wrong == 0


def test_a_streamed_run_at_batch_256_with_workers_decodes_every_jpeg_on_the_gpu(tmp_path):
    """Batch 256 from 4 workers (a tensor per JPEG ran out of file descriptors there), every
    JPEG counted as decoded by nvJPEG: a silent fall back to the CPU fails."""
    from stages.lib.shards import COUNTS
    from tests.support.training import stream_fit

    prep = streamed_folder(tmp_path, 600)
    before = (COUNTS.device, COUNTS.refused)
    run = stream_fit(prep, 4, epochs=1, batch_size=256, precision="auto",
                     **CUDA | {"loader": "auto"})
    assert run.loader == "stream" and run.device.startswith("cuda")
    assert COUNTS.device - before[0] >= 512 and COUNTS.refused == before[1]


def streamed_folder(tmp_path, count: int):
    """`count` noise JPEGs of 64 px prepared as shards at 32 px."""
    from tests.conftest import env_with, run, set_params
    from tests.support.image_files import noise_folder
    from tests.support.workspaces import folder_workspace

    w = folder_workspace(tmp_path / "w")
    noise_folder(w / "raw", count // 3, side=64)
    set_params(w / "params.yaml", {"data.format": "shards", "data.channels": "3",
                                   "data.image_size": "32", "data.val_fraction": "0.05",
                                   "data.test_fraction": "0.05"})
    run([sys.executable, "-m", "stages.prepare"], w, env=env_with(PYTHONPATH=str(ROOT)))
    return w / "data/prepared"


def record(name: str, value: dict) -> None:
    """A figure for gpu-check's summary, in GPU_CHECK_OUT (gpu-check/) when set."""
    import json
    import os
    from pathlib import Path

    if out := os.environ.get("GPU_CHECK_OUT"):
        Path(out, f"{name}.json").write_text(json.dumps(value, indent=1))


def test_streamed_training_on_cuda_decodes_on_the_gpu_bitwise_whatever_the_workers(jpeg_shards):
    from tests.support.training import stream_fit

    runs = [stream_fit(jpeg_shards, workers, precision="auto", **CUDA | {"loader": "auto"})
            for workers in (0, 2)]
    assert runs[0].loader == "stream" and runs[0].device.startswith("cuda")
    assert same_weights(runs[0].model, runs[1].model)


def test_the_stage_under_torchrun_with_one_process_on_cuda(tmp_path, digits, mlflow_uri):
    import json

    from stages.data import save_prepared
    from tests.conftest import env_with, run, set_params

    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", {"epochs": "2"})
    save_prepared(tmp_path / "data/prepared", *digits)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "-m", "stages.train"], tmp_path,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    assert json.loads((tmp_path / "models/train/metrics.json").read_text())["best_val_acc"] > 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_processes_stream_shards_through_the_stage(jpeg_shards, mlflow_uri):
    import json

    from tests.conftest import env_with, run, set_params

    w = jpeg_shards.parent.parent
    set_params(w / "params.yaml", {"epochs": "2", "train.nproc_per_node": "2"})
    run([sys.executable, "-m", "stages.train"], w,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    assert json.loads((w / "models/train/metrics.json").read_text())["epochs_run"] == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_processes_train_the_stage(tmp_path, digits, mlflow_uri):
    import json

    from stages.data import save_prepared
    from tests.conftest import env_with, run, set_params

    copy_params(tmp_path)
    set_params(tmp_path / "params.yaml", {"epochs": "3", "train.nproc_per_node": "2"})
    save_prepared(tmp_path / "data/prepared", *digits)
    run([sys.executable, "-m", "stages.train"], tmp_path,
        env=env_with(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=mlflow_uri))
    assert json.loads((tmp_path / "models/train/metrics.json").read_text())["best_val_acc"] > 0.9
