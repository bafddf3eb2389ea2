"""The CUDA path's findings, each shown on the CPU where its mechanism exists here:
GradScaler and fused optimizers run on the CPU, DDP runs between gloo processes. What only a GPU
can show is in tests/experiment/test_gpu.py (`make gpu-check`)."""

from __future__ import annotations

import datetime
import math
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from stages.checkpoints import latest_checkpoint
from stages.config import TrainConfig
from stages.data import Split, in_batches
from stages.loop import Job, RunIO, train
from stages.optim import EMA, build_optimizer
from stages.runtime import predict
from tests.support.training import (
    CPU_FP32,
    InfGradOnce,
    cnn,
    fit,
    fit_ckpt,
    linear_model,
    same_weights,
    sgd_step,
    uninitialized_memory_is_nan,
)


def test_fused_sgd_momentum_starts_at_zero_when_loss_scaling_skips_the_first_step():
    cfg = TrainConfig(optimizer="sgd", momentum=0.9, weight_decay=0.0)
    x, y = torch.randn(8, 1, 16, 16), torch.arange(8) % 10
    model, reference = linear_model(), linear_model()
    opt = build_optimizer(model, cfg, 0.1, torch.device("cpu"))
    ref_opt = build_optimizer(reference, cfg, 0.1, torch.device("cpu"))
    assert opt.defaults["fused"]  # the optimizer the loop uses on CPU and CUDA
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with uninitialized_memory_is_nan():
        # A forced overflow on the first step: scaled gradients beyond fp32's range.
        sgd_step(model, opt, scaler, x, y, blow_up=1e36)
        assert scaler.get_scale() == 2.0**15  # the step was skipped and the scale backed off
        buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
        assert all(torch.equal(b, torch.zeros_like(b)) for b in buffers)
        # The next good step is the first step a run without the overflow takes.
        sgd_step(model, opt, scaler, x, y)
        sgd_step(reference, ref_opt, torch.amp.GradScaler("cpu", init_scale=2.0**15), x, y)
    assert same_weights(model, reference)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_skipped_fp16_step_trains_on_and_its_inf_norm_is_not_averaged(digits, optimizer):
    result = fit(InfGradOnce(linear_model()), digits, epochs=2, precision="fp16",
                 optimizer=optimizer)
    norms = [r["grad_norm"] for r in result.history]
    assert all(math.isfinite(n) and n > 0 for n in norms), norms
    assert result.history[-1]["val_acc"] > 0.5  # momentum did not start from garbage


def test_validation_keeps_each_batch_when_the_model_reuses_its_output_memory(digits):
    """A CUDA-graph replay writes every call's output into the same memory, as this does."""

    class ReusesOutput(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner, self.out = inner, None

        def forward(self, x):
            y = self.inner(x)
            if self.out is None or self.out.shape != y.shape:
                self.out = torch.empty_like(y)
            return self.out.copy_(y)

    splits, meta = digits
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    model = linear_model()
    val, cpu = in_batches(splits["val"], 32, TrainConfig()), torch.device("cpu")
    assert torch.equal(predict(ReusesOutput(model), val, mean, std, device=cpu),
                       predict(model, val, mean, std, device=cpu))


def test_ema_matches_torch_averaged_model_without_a_device_counter(digits):
    model = cnn()
    ours = EMA(model, 0.9)
    theirs = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True)
    splits, meta = digits
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):  # real steps: weights and BatchNorm statistics move
        x = splits["train"].x[i * 16:(i + 1) * 16].float() / 255
        nn.functional.cross_entropy(model(x), splits["train"].y[i * 16:(i + 1) * 16]).backward()
        opt.step()
        opt.zero_grad()
        ours.update(model)
        theirs.update_parameters(model)
    for name, value in ours.module.state_dict().items():
        if value.is_floating_point():
            assert torch.equal(value, theirs.module.state_dict()[name]), name
        else:  # counters are the model's; AveragedModel blends integers into nonsense
            assert torch.equal(value, model.state_dict()[name]), name
    assert not any(t.numel() == 1 and t.dtype == torch.long for t in vars(ours).values()
                   if isinstance(t, torch.Tensor))  # no counter tensor
    restored = EMA(cnn(seed=3), 0.9)
    restored.load_state_dict(ours.state_dict())
    assert same_weights(restored.module, ours.module) and restored.updates == 4


@pytest.mark.parametrize("before, after", [("fp16", "fp32"), ("fp32", "fp16")])
def test_resume_across_a_change_of_resolved_precision_warns_and_goes_on(digits, tmp_path,
                                                                         before, after):
    fit_ckpt(cnn(), digits, tmp_path, epochs=1, precision=before)
    state = latest_checkpoint(tmp_path)
    assert (state["device"], state["precision"]) == ("cpu", before)
    with pytest.warns(UserWarning, match=f"trained in {before} on cpu, this run is {after}"):
        result = fit_ckpt(cnn(), digits, tmp_path, epochs=2, resume=state, precision=after)
    assert result.epochs_run == 2 and math.isfinite(result.history[-1]["val_loss"])


def test_deterministic_refuses_a_compile_mode_it_would_silently_turn_off():
    from stages.config import ParamsError

    with pytest.raises(ParamsError, match="train.compile='max-autotune'.*deterministic: false"):
        TrainConfig(compile="max-autotune", deterministic=True)
    TrainConfig(compile="max-autotune", deterministic=False)
    TrainConfig(compile=True, deterministic=True)


# ------------------------------------------------------------ two gloo processes


def _ddp_worker(rank: int, world: int, init: str, data: dict, ckpt_dir: str, resume_epoch: int,
                out: str) -> None:
    torch.set_num_threads(1)
    # A short timeout: ranks whose decisions split would otherwise wait 30 minutes.
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = cnn() if data["model"] == "cnn" else linear_model()
        resume = None
        if resume_epoch:
            resume = torch.load(Path(ckpt_dir) / f"epoch-{resume_epoch:04d}.pt", weights_only=True)
        val = data["val"][rank]  # each process its own validation split, when they differ
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            job = Job(train=data["train"], val=val, mean=data["mean"], std=data["std"],
                      cfg=TrainConfig(**{**CPU_FP32, **data["cfg"]}), lr=3e-3,
                      epochs=data["epochs"], batch_size=32, seed=0, rank=rank, world=world)
            result = train(model, job, RunIO(ckpt_dir=Path(ckpt_dir), resume=resume,
                                             progress=False, verbose=False))
        torch.save({"weights": result.model.state_dict(), "history": result.history,
                    "draw": torch.rand(4), "best_epoch": result.best_epoch},
                   f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


def ddp(tmp_path, name: str, data: dict, resume_epoch: int = 0) -> list[dict]:
    out = tmp_path / name
    torch.multiprocessing.spawn(
        _ddp_worker, args=(2, f"file://{tmp_path / (name + '.pg')}", data,
                           str(tmp_path / "ckpt"), resume_epoch, str(out)), nprocs=2)
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1)]


def test_each_rank_draws_its_own_dropout_and_a_resumed_ddp_run_ends_where_it_would(digits,
                                                                                    tmp_path):
    splits, meta = digits
    data = {"train": Split(splits["train"].x[:256], splits["train"].y[:256]),
            "val": [splits["val"]] * 2, "mean": meta["mean"], "std": meta["std"],
            "model": "cnn", "cfg": {"augment_crop_pad": 1}, "epochs": 3}
    full = ddp(tmp_path, "full", data)
    assert not torch.equal(full[0]["draw"], full[1]["draw"])  # each rank its own stream
    # As if killed during epoch 3: every rank resumes from the epoch-2 checkpoint rank 0 wrote.
    resumed = ddp(tmp_path, "resumed", data, resume_epoch=2)
    for rank in (0, 1):
        assert all(torch.equal(resumed[rank]["weights"][k], full[rank]["weights"][k])
                   for k in full[rank]["weights"])
        assert torch.equal(resumed[rank]["draw"], full[rank]["draw"])


def test_every_rank_takes_rank_0s_validation_figures_and_decisions(digits, tmp_path):
    """Validation that differs between processes (here: other images on rank 1; on GPUs, one
    ULP from per-process cudnn tuning) must not split the best-epoch, plateau and early
    stopping decisions."""
    splits, meta = digits
    val = splits["val"]
    other = Split(val.x.flip(-1), val.y)  # mirrored digits: other figures
    data = {"train": Split(splits["train"].x[:256], splits["train"].y[:256]),
            "val": [val, other], "mean": meta["mean"], "std": meta["std"], "model": "linear",
            "cfg": {"schedule": "plateau", "plateau_patience": 1, "early_stopping_patience": 2},
            "epochs": 6}
    ranks = ddp(tmp_path, "decisions", data)
    figures = [[(r["val_loss"], r["val_acc"], r["lr"]) for r in rank["history"]] for rank in ranks]
    assert figures[0] == figures[1]
    assert ranks[0]["best_epoch"] == ranks[1]["best_epoch"]


# ------------------------------------------------------------ the streamed GPU decode, on the CPU


def jpeg_split(folder: Path, count: int, side: int = 24, **save) -> Split:
    """`count` noise JPEGs (Pillow's `save` options) as a shard split at 16 px."""
    import numpy as np
    from PIL import Image

    from stages.lib.images import Files
    from stages.lib.shards import ShardImages, write_split

    rng = np.random.default_rng(0)
    (folder / "raw").mkdir(parents=True)
    paths = [str(folder / "raw" / f"{i:04d}.jpg") for i in range(count)]
    for path in paths:
        Image.fromarray(rng.integers(0, 256, (side, side + 8, 3), dtype=np.uint8)).save(
            path, quality=90, **save)
    write_split(folder / "split", Files.of(paths, 0), 3, 16, "squash", 256, 2**20, 1)
    x = ShardImages(folder / "split", 3, 16, "squash")
    return Split(x, x.labels())


STREAM_256 = """
import resource, sys, torch
from pathlib import Path
from stages.batches import EncodedStream, EpochSampler
from stages.data import Split, in_batches
from stages.lib.shards import ShardImages

limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
x = ShardImages(Path(sys.argv[1]), 3, 16, "squash")
dl = torch.utils.data.DataLoader(
    EncodedStream(Split(x, x.labels()), 0), batch_size=256, num_workers=2,
    sampler=EpochSampler(len(x), 0, keyed=True), collate_fn=EncodedStream.collate,
    prefetch_factor=2, drop_last=True, timeout=20)
for epoch in range(2):
    dl.sampler.set_epoch(epoch)
    got = [batch[-1] for batch in dl]
    assert [len(b) for b in got] == [256, 256], [len(b) for b in got]
print("ok")
"""


def test_a_streamed_batch_of_256_jpegs_crosses_from_the_workers_under_a_low_open_files_limit(
        tmp_path):
    """The GPU path's batches (EncodedStream.collate) at batch 256 from two workers, under
    `ulimit -n 128`: a tensor per JPEG took a descriptor each on its way from a worker."""
    import subprocess
    import sys

    from tests.conftest import ROOT, env_with

    jpeg_split(tmp_path, 520, side=8)
    done = subprocess.run([sys.executable, "-c", STREAM_256, str(tmp_path / "split"), "128"],
                          cwd=ROOT, env=env_with(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def cpu_decoder(payloads: list[torch.Tensor]) -> list[torch.Tensor]:
    """torchvision's decode_jpeg on the CPU, as the GPU path calls nvJPEG: a real decoder that
    refuses some JPEGs Pillow reads (a grey lossless one, to RGB)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)
        return decode_jpeg(payloads, mode=ImageReadMode.RGB)


def test_a_jpeg_the_decoder_refuses_is_cropped_by_pillow_and_a_corrupt_one_named(tmp_path):
    """The batched call fails for one image; the batch is decoded image by image and the one
    refused is Pillow's crop of the same box, as the CPU path gives it: a function of (seed,
    epoch, index). A JPEG Pillow cannot read either fails in one line naming it."""
    import io

    import numpy as np
    from PIL import Image

    from stages.batches import EncodedStream, crop_boxes
    from stages.lib import shards
    from stages.lib.images import DataError, Files
    from tests.support.image_files import lossless_jpeg

    rng = np.random.default_rng(0)
    paths = [str(tmp_path / f"{i}.jpg") for i in range(3)]
    for path in paths[::2]:
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(path, quality=90)
    Path(paths[1]).write_bytes(lossless_jpeg(rng.integers(0, 256, (40, 56), dtype=np.uint8)))
    shards.write_split(tmp_path / "split", Files.of(paths, 0), 3, 16, "squash", 256, 2**20, 1)
    x = shards.ShardImages(tmp_path / "split", 3, 16, "squash")
    boxes = crop_boxes(0, 1, torch.arange(3), ((0.35, 1.0), (0.75, 4 / 3)))

    def encoded(i: int) -> tuple:  # jpeg_crop's payload and box, for any JPEG
        data = x.raw(i)
        width, height = Image.open(io.BytesIO(data)).size
        box = x.box(boxes[i], width, height)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), box, x.labels()[i], i

    def crop(k: int) -> torch.Tensor:
        return x.cropped(k, boxes[k])

    batch = EncodedStream.collate([encoded(i) for i in range(3)])
    before = shards.COUNTS.refused
    out = shards.decoded_batch(*batch[:4], 16, 3, torch.device("cpu"), cpu_decoder, crop)
    assert shards.COUNTS.refused == before + 1
    assert torch.equal(out[1], crop(1))
    assert all((out[k].int() - crop(k).int()).abs().float().mean() < 1 for k in (0, 2))
    # Sample 1 cut short in its shard (its end marker zeroed): neither decoder reads it.
    shard, offset, size, _ = x.index[1].tolist()
    with open(tmp_path / "split" / shards.shard_name(shard), "r+b") as f:
        f.seek(offset + size - 2)
        f.write(b"\0\0")
    x = shards.ShardImages(tmp_path / "split", 3, 16, "squash")
    with pytest.raises(DataError, match=r"shard-000000.tar: sample 1 does not decode \(a damaged"):
        shards.decoded_batch(*batch[:4], 16, 3, torch.device("cpu"), cpu_decoder, crop)


def test_progressive_jpegs_are_decoded_in_the_workers_not_on_the_training_thread(tmp_path):
    """nvJPEG decodes a progressive JPEG on the host, one at a time, on the training thread:
    the workers decode it instead (its box -1), to the CPU path's crop."""
    from stages.batches import EncodedStream, StreamedDataset
    from stages.lib.shards import GPU_FRAMES, frame_marker

    split = jpeg_split(tmp_path / "p", 3, progressive=True)
    assert frame_marker(split.x.raw(0)) == 0xC2
    enc, ref = EncodedStream(split, 0), StreamedDataset(split, 0)
    for i in range(3):
        x, box, *_ = enc[(i, 1)]
        assert box[0] == -1 and torch.equal(x, ref[(i, 1)][0])
    baseline = jpeg_split(tmp_path / "b", 1)
    assert frame_marker(baseline.x.raw(0)) in GPU_FRAMES and EncodedStream(baseline, 0)[(0, 1)][1][0] >= 0


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a GPU machine runs the check")
def test_gpu_check_stops_at_once_in_one_line_without_a_gpu(tmp_path):
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    t = time.monotonic()
    done = subprocess.run(["make", "-s", "gpu-check", f"PY={sys.executable}",
                           f"GPU_CHECK_OUT={tmp_path / 'out'}"], cwd=ROOT, capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items()
                                          if k != "GPU_CHECK_DRY"})
    assert time.monotonic() - t < 2 and done.returncode != 0
    assert done.stderr.splitlines()[0].startswith("gpu-check: no NVIDIA GPU on this machine")
    assert not (tmp_path / "out").exists()
