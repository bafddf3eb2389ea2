"""The training loop's guarantees, on the real digits and the real loop."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from reprotrain import tracking
from stages.checkpoints import latest_checkpoint
from stages.config import TrainConfig
from stages.data import Images, Split
from stages.loop import NonFiniteLossError
from stages.metrics import EPOCH, HISTORY, EpochMetric, epoch_line
from stages.optim import Schedule
from tests.conftest import ROOT
from tests.support.training import cnn, fit, fit_ckpt, linear_model, max_diff, same_weights


@pytest.mark.parametrize("n", [64, 56])  # 56: the last accumulation window is short (4 + 3)
def test_accumulation_equals_the_full_batch(digits, n):
    accumulated = fit(linear_model(), digits, n=n, batch_size=8, accumulate=4).model
    full = fit(linear_model(), digits, n=n, batch_size=32, accumulate=1).model
    assert max_diff(accumulated, full) < 1e-5
    untrained = linear_model()
    assert max_diff(full, untrained) > 1e-3  # it did train


def schedule(kind: str, warmup_epochs: float = 1.0, **settings) -> Schedule:
    """100 steps: 10 epochs of 10."""
    cfg = TrainConfig(schedule=kind, warmup_epochs=warmup_epochs, **settings)
    return Schedule(cfg, lr=1.0, steps_per_epoch=10, epochs=10)


def test_warmup_and_cosine_endpoints():
    s = schedule("cosine", min_lr=0.01)
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(9) == pytest.approx(1.0)  # warmup ends at the peak
    assert s.lr_at(10) == pytest.approx(1.0)  # cosine starts at the peak
    assert s.lr_at(99) == pytest.approx(0.01)  # and ends at min_lr
    assert s.lr_at(10 + 89 / 2) == pytest.approx((1.0 + 0.01) / 2)
    lrs = [s.lr_at(i) for i in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert schedule("cosine", warmup_epochs=0).lr_at(0) == pytest.approx(1.0)
    step = schedule("step", warmup_epochs=0, step_epochs=3, step_gamma=0.1)
    assert [step.lr_at(i) for i in (0, 29, 30, 60)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    assert schedule("constant").lr_at(77) == 1.0


def test_plateau_cuts_after_each_patience_of_stalled_epochs_and_resumes_its_cut():
    s = schedule("plateau", warmup_epochs=0, plateau_patience=2, plateau_factor=0.5)
    for stalled in (0, 1, 2, 3, 4):  # cuts at 2 and 4 epochs without improvement
        s.after_validation(stalled)
    assert s.lr_at(50) == pytest.approx(0.25)
    resumed = dataclasses.replace(s, scale=1.0)
    resumed.load_state_dict(s.state_dict())
    assert resumed.lr_at(50) == s.lr_at(50)
    cosine = schedule("cosine")
    cosine.after_validation(2)  # only plateau reacts to validation
    assert cosine.scale == 1.0


def test_clipping_bounds_the_update(digits):
    model = linear_model()
    before = [p.detach().clone() for p in model.parameters()]
    lr, clip = 0.5, 0.01
    result = fit(model, digits, n=32, batch_size=32, lr=lr, optimizer="sgd", momentum=0.0,
                 weight_decay=0.0, clip_grad_norm=clip, warmup_epochs=0)
    step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before,
                                                                 strict=True)])
    # One plain SGD step: the update is lr times the clipped gradient.
    assert step.norm().item() == pytest.approx(lr * clip, rel=1e-3)
    assert result.history[0]["grad_norm"] > clip  # logged before clipping: it was clipped


class NanAfter(nn.Module):
    """A real model whose output turns NaN after `after` training forward passes."""

    def __init__(self, inner: nn.Module, after: int):
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, x):
        out = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                out = out * float("nan")
        return out


def test_nonfinite_loss_stops_within_one_step_and_keeps_the_checkpoint(digits, tmp_path):
    model = NanAfter(linear_model(), after=25)  # 20 steps per epoch: NaN at step 25, epoch 2
    with pytest.raises(NonFiniteLossError) as err:
        fit_ckpt(model, digits, tmp_path, epochs=5)
    msg = str(err.value)
    assert "step 25 " in msg and "epoch 2" in msg and "lower lr" in msg
    assert "epoch-0001.pt" in msg
    assert model.calls == 26  # stopped at the step it happened
    state = latest_checkpoint(tmp_path)
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_same_params_and_seed_give_bitwise_identical_weights(digits):
    a = fit(cnn(), digits, epochs=2, precision="auto", augment_crop_pad=1).model
    b = fit(cnn(), digits, epochs=2, precision="auto", augment_crop_pad=1).model
    assert same_weights(a, b)
    c = fit(cnn(), digits, epochs=2, precision="auto", augment_crop_pad=1, seed=1).model
    assert not same_weights(a, c)


def test_dataloader_path_matches_device_path_whatever_the_workers(digits):
    """Same order and index-keyed augmentation: the loader and worker count do not matter."""
    kw = dict(n=256, epochs=2, augment_crop_pad=1)
    device = fit(cnn(), digits, **kw).model
    for workers in (0, 2):
        loaded = fit(cnn(), digits, loader="dataloader", num_workers=workers, **kw).model
        assert same_weights(device, loaded), workers


def test_resume_from_a_checkpoint_ends_where_an_uninterrupted_run_does(digits, tmp_path):
    full = fit_ckpt(cnn(), digits, tmp_path / "full", epochs=3, augment_crop_pad=1)
    part = tmp_path / "part"
    fit_ckpt(cnn(), digits, part, epochs=3, augment_crop_pad=1)
    # Drop the epoch-3 checkpoint, as if the process died during epoch 3.
    (part / "epoch-0003.pt").unlink()
    state = latest_checkpoint(part)
    assert state["epoch"] == 2
    resumed = fit_ckpt(cnn(seed=99), digits, part, epochs=3, resume=state, augment_crop_pad=1)
    assert same_weights(full.model, resumed.model)
    learning = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr", "grad_norm")
    assert [{k: r[k] for k in learning} for r in resumed.history] == \
        [{k: r[k] for k in learning} for r in full.history]


def test_overfit_mode_learns_its_batches(digits):
    result = fit(cnn(width=16), digits, epochs=30, batch_size=32, overfit_batches=2,
                 augment_crop_pad=1)
    assert result.history[-1]["train_acc"] >= 0.98
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"] / 5


class ListImages:
    """A format of its own: a list of (C, H, W) tensors, giving stages.data.Images and nothing
    more (no Tensor method, no ShardImages one)."""
    dtype = torch.uint8

    def __init__(self, x: torch.Tensor):
        self.images, self.shape = list(x.clone()), tuple(x.shape)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.images[key]
        picked = range(len(self))[key] if isinstance(key, slice) else key.tolist()
        return torch.stack([self.images[i] for i in picked])


@pytest.mark.parametrize("loader", ["auto", "device", "dataloader"])
def test_a_format_giving_images_trains_as_tensors_do_through_the_loader_params_choose(digits,
                                                                                      loader):
    """A new format needs Images alone: the loader is train.loader's, not picked by its type."""
    splits, meta = digits
    small = dict(splits, train=Split(splits["train"].x[:256], splits["train"].y[:256]))
    own = {name: Split(ListImages(s.x), s.y) for name, s in small.items()}
    assert isinstance(own["train"].x, Images) and not isinstance(own["train"].x, torch.Tensor)
    kw = dict(loader=loader, num_workers=0, augment_crop_pad=1, augment_hflip=True)
    tensors, listed = fit(linear_model(), (small, meta), **kw), fit(linear_model(), (own, meta), **kw)
    assert tensors.loader == listed.loader == ("device" if loader == "auto" else loader)
    assert same_weights(tensors.model, listed.model) and not same_weights(listed.model, linear_model())
    assert tensors.history[-1]["val_loss"] == listed.history[-1]["val_loss"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_paths_train(digits, precision):
    """Each reduced precision trains as fp32 does: the same loss curve to a tolerance that
    bf16's 8-bit mantissa leaves (a broken scaler or autocast misses it by far)."""
    result = fit(cnn(), digits, n=256, epochs=2, precision=precision)
    reference = fit(cnn(), digits, n=256, epochs=2, precision="fp32")
    assert result.precision == precision
    losses = [r["train_loss"] for r in result.history]
    assert losses[-1] < 0.95 * losses[0], losses  # it learns
    assert losses == pytest.approx([r["train_loss"] for r in reference.history], abs=0.01)


def test_ema_keeps_the_average_and_its_decay_counts(digits):
    """Validation and the kept weights are the EMA's. Decay 0 averages nothing: the last
    step's weights, as without EMA; decay 0.9 keeps other weights."""
    plain = fit(cnn(), digits, n=256, epochs=2)
    last = fit(cnn(), digits, n=256, epochs=2, ema=True, ema_decay=0.0)
    averaged = fit(cnn(), digits, n=256, epochs=2, ema=True, ema_decay=0.9)
    assert set(averaged.model.state_dict()) == set(cnn().state_dict())  # EMA wrapper unwrapped
    assert max_diff(last.model, plain.model) < 1e-6
    assert max_diff(averaged.model, plain.model) > 1e-3
    assert averaged.history[-1]["val_loss"] != plain.history[-1]["val_loss"]


def test_label_smoothing_puts_a_floor_under_the_training_loss(digits):
    """Smoothed targets (0.1 over 10 classes) have an entropy of 0.50: no model's loss on them
    goes lower, while the same run on plain targets goes well below it."""
    floor = -(0.91 * math.log(0.91) + 9 * 0.01 * math.log(0.01))
    plain = fit(cnn(), digits, epochs=4)
    smoothed = fit(cnn(), digits, epochs=4, label_smoothing=0.1)
    assert plain.history[-1]["train_loss"] < floor - 0.05
    assert min(r["train_loss"] for r in smoothed.history) >= floor - 1e-4
    assert smoothed.history[-1]["val_acc"] > 0.8  # it trained: the floor is the targets'


def test_sgd_steps_by_lr_times_the_gradient(digits):
    """optimizer: sgd, no momentum or decay: one step moves the weights by exactly lr times the
    gradient (AdamW's step would be about lr per weight, whatever the gradient)."""
    model = linear_model()
    before = [p.detach().clone() for p in model.parameters()]
    lr = 0.5
    result = fit(model, digits, n=32, batch_size=32, lr=lr, optimizer="sgd", momentum=0.0,
                 weight_decay=0.0, clip_grad_norm=0.0, warmup_epochs=0)
    step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before,
                                                                 strict=True)])
    assert result.history[0]["grad_norm"] > 1.0  # so clipping, were it on, would show
    assert step.norm().item() == pytest.approx(lr * result.history[0]["grad_norm"], rel=1e-3)


def test_early_stopping_and_plateau(digits):
    # lr so small nothing changes: val accuracy never improves after the first epoch.
    result = fit(linear_model(), digits, epochs=10, lr=1e-12, early_stopping_patience=3,
                 schedule="plateau", plateau_patience=1, plateau_factor=0.5, warmup_epochs=0)
    assert result.stopped_early and result.epochs_run == 4
    lrs = [r["lr"] for r in result.history]
    assert lrs[1] == pytest.approx(lrs[0]) and lrs[2] == pytest.approx(lrs[1] / 2)


def test_compiled_training_saves_the_uncompiled_weights(digits):
    model = linear_model()
    result = fit(model, digits, n=64, compile=True)
    assert set(result.model.state_dict()) == {"1.weight", "1.bias"}  # no _orig_mod. prefix
    assert max_diff(result.model, linear_model()) > 1e-3


def test_cpu_peak_memory_restarts_so_an_earlier_peak_does_not_show_through():
    """In a fresh process: in a long-lived test worker, memory other tests freed can be reused
    without RSS growing, and the small allocation then shows no peak at all."""
    code = """
import sys, torch
from stages.runtime import peak_mem_mb, proc_status_mb, reset_peak_mem
cpu = torch.device("cpu")
def peak_above_start(numel):
    if not reset_peak_mem(cpu):
        sys.exit(3)
    start = proc_status_mb("VmRSS")
    x = torch.ones(numel)
    del x
    return peak_mem_mb(cpu) - start
print(peak_above_start(50_000_000), peak_above_start(10_000_000))  # 191 MiB, then 38 MiB
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    if p.returncode == 3:
        pytest.skip("this kernel does not allow resetting the peak (/proc/self/clear_refs)")
    big, small = map(float, p.stdout.split())
    assert 180 < big < 260, p.stdout
    # The kernel's peak was reset: the earlier 191 MiB does not show through.
    assert 30 < small < 100, p.stdout


def test_an_epoch_metric_declared_once_reaches_the_row_mlflow_and_the_printed_line(digits,
                                                                                  capsys):
    logged = {}
    result = fit(linear_model(), digits, n=256, epochs=1, batch_size=32,
                 log=lambda metrics, step, durable=False: logged.update(metrics) if durable else 0)
    row = result.history[0]
    assert list(row) == ["epoch", *EPOCH]
    assert logged.keys() == EPOCH.keys()
    assert {tracking.metric_name(k) for k in logged} == {m.mlflow for m in EPOCH.values()}
    # samples/s is of the epoch's training pass only, so at least its share of the whole epoch
    assert row["samples_per_s"] * row["epoch_s"] >= 256
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == epoch_line(row, 1) and line.startswith("epoch 1/1 train_loss ")
    assert f"val_acc {row['val_acc']:.4f}" in line and "samples/s" in line
    assert HISTORY == ["epoch", *(k for k in row if EPOCH.get(k) and EPOCH[k].history)]


def test_an_epoch_metric_declared_but_not_computed_fails_naming_it(digits, monkeypatch):
    monkeypatch.setitem(EPOCH, "val_top5", EpochMetric("val/top5", True))
    with pytest.raises(RuntimeError, match=r"\['val_top5'\]: computed in stages/loop.py or "
                                           r"declared in stages/metrics.py EPOCH"):
        fit(linear_model(), digits, n=64, epochs=1)


def test_the_global_batch_rule_is_one_check_with_one_message():
    """batch_size is the global batch: the params check, `auto`'s count and the formed group all
    refuse a batch that does not split evenly, with the same line naming the key."""
    from stages.batches import plan_batches
    from stages.config import ParamsError, batch_share

    with pytest.raises(ParamsError, match=r"^params.yaml: batch_size=10 is invalid: must be a "
                       r"multiple of the 4 processes: each process takes an equal share"):
        plan_batches(100, 10, 4, 1)
    assert batch_share(12, 4, "x") == 3
    assert plan_batches(100, 12, 4, 1).sizes[0] == 3
