"""Training batches: the batch plan, the batch sources (device-resident data, a DataLoader over
the tensors, or one that decodes shards in its workers) and the augmentation. Each gives every
sample in the same order with the same augmentation, whatever the worker count or rank; the two
of the tensors give the same batches. The augmentation is the params' alone, the same for tensors
and shards: a shard's random-resized crop is cut in a worker from its stored resolution, a
tensor's on the device, with the same box."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from stages.config import TrainConfig, batch_share
from stages.data import BATCH_TIMEOUT_S, Split, from_workers, resolve_workers
from stages.lib.shards import decoded_batch, nvjpeg, resized_crops

# A random-resized crop's (area, aspect ratio) ranges: train.augment_crop_scale and _ratio.
Crop = tuple[tuple[float, float], tuple[float, float]]

# epoch -> this process's micro-batches (uint8 images, labels, sample indices), on the device.
Batches = Callable[[int], Iterator[tuple[Tensor, Tensor, Tensor]]]


@dataclass(kw_only=True)
class BatchPlan:
    sizes: list[int]  # this process's micro-batch sizes, the same every epoch
    accumulate: int  # micro-batches per optimizer step

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.sizes) // self.accumulate)


def plan_batches(n: int, batch_size: int, world: int, accumulate: int) -> BatchPlan:
    """`batch_size` is the global batch: each of the `world` processes takes an equal share."""
    local_bs, per_rank = batch_share(batch_size, world, f"the {world} processes"), n // world
    sizes = [min(local_bs, per_rank - i) for i in range(0, per_rank, local_bs)]
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes.pop()  # a batch of one breaks BatchNorm's batch statistics
    return BatchPlan(sizes=sizes, accumulate=accumulate)


def windows(batches: Iterator, plan: BatchPlan) -> Iterator[list]:
    """The micro-batches of each optimizer step."""
    for _ in range(plan.steps_per_epoch):
        yield list(itertools.islice(batches, plan.accumulate))


def device_batches(split: Split, plan: BatchPlan, device: torch.device, seed: int,
                   shuffle: bool, rank: int, world: int) -> Batches:
    # The whole split lives on the device as uint8 (4x smaller than float): batches are
    # index_select calls, no per-sample Python, no host-to-device copy per step.
    x_all, y_all = split.x[:].to(device), split.y.to(device)

    def epoch_batches(epoch: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        order = rank_order(len(split.y), seed, epoch, shuffle, rank, world).to(device)
        for idx in order[:sum(plan.sizes)].split(plan.sizes):
            yield x_all[idx], y_all[idx], idx

    return epoch_batches


def random_resized_crop(cfg: TrainConfig) -> Crop | None:
    """The crop train.augment_crop_scale and _ratio ask for; None for none (area [1, 1] with
    the ratio 1 allowed: every draw is the whole image)."""
    scale, ratio = tuple(cfg.augment_crop_scale), tuple(cfg.augment_crop_ratio)
    return None if scale == (1, 1) and ratio[0] <= 1 <= ratio[1] else (scale, ratio)


def loader_batches(split: Split, plan: BatchPlan, device: torch.device, seed: int,
                   shuffle: bool, rank: int, world: int, num_workers: int | str,
                   crop: Crop | None = None, *, streamed: bool = False) -> Batches:
    """train.loader: dataloader, or `streamed`, stream: a shards' workers decode its samples and
    cut `crop` (stages/lib/shards.py `cropped`); tensors get theirs in `augment`."""
    workers = resolve_workers(num_workers)
    # On CUDA the GPU decodes the JPEGs (nvJPEG): workers only read them and draw their crops.
    on_gpu = streamed and device.type == "cuda"
    sampler = EpochSampler(len(split.y), seed, shuffle, rank, world, keyed=streamed)
    dataset = (EncodedStream if on_gpu else StreamedDataset)(split, seed, crop) if streamed \
        else IndexedDataset(split)
    dl = torch.utils.data.DataLoader(
        dataset, batch_size=plan.sizes[0], sampler=sampler, num_workers=workers,
        # Pinned (page-locked) host memory lets the copy below run asynchronously via DMA.
        pin_memory=device.type == "cuda",
        # Workers stay alive across epochs instead of being forked again every epoch.
        persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
        drop_last=sum(plan.sizes) < len(sampler),
        # Its own generator: a DataLoader otherwise draws worker seeds from the global RNG
        # each epoch, which shifts the dropout masks away from the device path's.
        generator=torch.Generator().manual_seed(seed), worker_init_fn=seed_worker,
        collate_fn=EncodedStream.collate if on_gpu else None,
        timeout=BATCH_TIMEOUT_S if workers else 0)
    decode = nvjpeg(device, split.x.channels) if on_gpu else None

    def epoch_batches(epoch: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        sampler.set_epoch(epoch)
        for batch in from_workers(dl) if workers else dl:
            if on_gpu:
                pixels, data, lengths, boxes, y, idx = batch
                # What nvJPEG refuses, Pillow decodes here in the same box: still a function of
                # (seed, epoch, index); a corrupt sample fails naming it.
                x = decoded_batch(pixels, data, lengths, boxes, split.x.size, split.x.channels,
                                  device, decode, lambda k, idx=idx, epoch=epoch:
                                  dataset.on_cpu(int(idx[k]), epoch))
            else:
                x, y, idx = batch
            # non_blocking: the copy overlaps with compute (it is async from pinned memory).
            yield (x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                   idx.to(device, non_blocking=True))

    return epoch_batches


def seed_worker(worker_id: int) -> None:
    """numpy and random in a worker from the seed torch derived for it (base seed + worker id)."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _hash(seed: int, epoch: int, idx: Tensor, salt: int) -> Tensor:
    # splitmix-style integer mixing of (seed, epoch, sample index): a sample gets the same
    # augmentation whatever batch, worker, loader or rank draws it, so results do not depend
    # on num_workers and a resumed epoch replays exactly. int64 products wrap on every device.
    base = ((seed * 1_000_003 + epoch) * 7919 + salt) * 0x632BE59BD9B4E019 % 2**63
    z = idx.long() + base
    for _ in range(2):
        z = (z ^ (z >> 31)) * 0x5851F42D4C957F2D
    return (z ^ (z >> 29)).abs()


def uniform(seed: int, epoch: int, idx: Tensor, salt: int, draws: int) -> Tensor:
    """(N, draws) float64 in [0, 1), keyed like `_hash`."""
    keys = idx.long()[:, None] * draws + torch.arange(draws, device=idx.device)
    return (_hash(seed, epoch, keys, salt) % 2**53).double() / 2**53


def crop_boxes(seed: int, epoch: int, idx: Tensor, crop: Crop) -> Tensor:
    """(N, 4) float64: each sample's random-resized crop, (top, left, height, width) as fractions
    of the image as `fit` frames it (so the same box for tensors and shards, at any resolution):
    torchvision's RandomResizedCrop draw, ten tries, then the whole image cut to the nearest
    ratio allowed. The ratio is width/height in the image as validation sees it."""
    (s_lo, s_hi), (r_lo, r_hi) = crop
    u = uniform(seed, epoch, idx, 4, 40).view(-1, 10, 4)
    area = s_lo + (s_hi - s_lo) * u[..., 0]
    ratio = torch.exp(math.log(r_lo) + (math.log(r_hi) - math.log(r_lo)) * u[..., 1])
    w, h = (area * ratio).sqrt(), (area / ratio).sqrt()
    fits = (w <= 1) & (h <= 1)
    first = fits.int().argmax(1, keepdim=True)  # the first try that fits (argmax: the first max)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    top, left = (1 - h) * u[..., 2].gather(1, first)[:, 0], (1 - w) * u[..., 3].gather(1, first)[:, 0]
    whole_h, whole_w = min(1.0, 1 / r_lo), min(1.0, r_hi)  # the image is square as `fit` frames it
    box = torch.stack([top, left, h, w], 1)
    whole = torch.tensor([(1 - whole_h) / 2, (1 - whole_w) / 2, whole_h, whole_w],
                         dtype=torch.float64, device=idx.device)
    return torch.where(fits.any(1, keepdim=True), box, whole)


def augment(x: Tensor, idx: Tensor, seed: int, epoch: int, pad: int, hflip: bool,
            crop: Crop | None = None) -> Tensor:
    """Batched random-resized crop (of tensors: a shard's comes cropped), random crop with zero
    padding and flip, on whatever device x is."""
    n, _, h, w = x.shape
    if crop is not None:
        boxes = crop_boxes(seed, epoch, idx, crop) * torch.tensor([h, w, h, w], device=x.device)
        x = resized_crops(list(x), boxes, h)
    if pad:
        xp = F.pad(x, (pad, pad, pad, pad))
        dy = _hash(seed, epoch, idx, 1) % (2 * pad + 1)
        dx = _hash(seed, epoch, idx, 2) % (2 * pad + 1)
        rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]  # (N, H, 1)
        cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]  # (N, 1, W)
        x = xp[torch.arange(n, device=x.device)[:, None, None], :, rows, cols]  # (N, H, W, C)
        x = x.permute(0, 3, 1, 2)
    if hflip:
        flip = (_hash(seed, epoch, idx, 3) % 2).bool().view(-1, 1, 1, 1)
        x = torch.where(flip, x.flip(-1), x)
    return x.contiguous()


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    """The sample order of one epoch, a pure function of (seed, epoch): resume needs no RNG state."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)


class IndexedDataset(torch.utils.data.Dataset):
    """Samples with their index, so augmentation can be keyed by it after the transfer."""

    def __init__(self, split: Split):
        self.x, self.y = split.x, split.y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        return self.x[i], self.y[i], i


def rank_order(n: int, seed: int, epoch: int, shuffle: bool, rank: int = 0,
               world: int = 1) -> Tensor:
    """This process's share of the epoch order: every `world`-th sample from `rank`, after
    dropping the tail that does not divide evenly (every rank must take the same number of
    steps, or DDP waits forever). The ranks' k-th batches together are exactly the
    single-process k-th batch of the global batch size."""
    order = epoch_order(n, seed, epoch) if shuffle else torch.arange(n)
    return order[: n - n % world][rank::world]


class EpochSampler(torch.utils.data.Sampler):
    """The device path's order for the DataLoader path (sharded like DistributedSampler, with
    drop_last); set_epoch works with persistent workers. `keyed`: (index, epoch) pairs, for a
    dataset whose samples depend on the epoch (a worker's copy never sees set_epoch)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1,
                 keyed: bool = False):
        self.n, self.seed, self.shuffle, self.rank, self.world = n, seed, shuffle, rank, world
        self.epoch, self.keyed = 0, keyed

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = rank_order(self.n, self.seed, self.epoch, self.shuffle, self.rank,
                           self.world).tolist()
        return iter((i, self.epoch) for i in order) if self.keyed else iter(order)

    def __len__(self) -> int:
        return self.n // self.world


class StreamedDataset(torch.utils.data.Dataset):
    """A sharded split's samples, decoded in the DataLoader's workers, each through its random-
    resized crop (`crop_boxes`, keyed like `augment` by (seed, epoch, index)) when `crop` asks
    for one, or as validation decodes it (the tensors' image) when not."""

    def __init__(self, split: Split, seed: int, crop: Crop | None = None):
        self.x, self.y, self.seed, self.crop = split.x, split.y, seed, crop

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, key: tuple[int, int]) -> tuple:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[tuple]:
        """A batch's (*sample, label, index), its crops drawn at once; a sample's DataError
        reaches the training process in one line (data.from_workers)."""
        idx = torch.tensor([i for i, _ in keys])
        # A batch's keys are one epoch's (EpochSampler).
        boxes = crop_boxes(self.seed, keys[0][1], idx, self.crop) if self.crop else \
            [None] * len(keys)
        return [(*self.sample(i, box), self.y[i], i) for i, box in zip(idx.tolist(), boxes, strict=True)]

    def sample(self, i: int, box: Tensor | None) -> tuple[Tensor, ...]:
        return (self.x.decoded(i) if box is None else self.x.cropped(i, box),)

    def on_cpu(self, i: int, epoch: int) -> Tensor:
        """Sample i of `epoch` decoded by Pillow here, its crop drawn again: where the GPU's
        decoder refuses it."""
        box = crop_boxes(self.seed, epoch, torch.tensor([i]), self.crop)[0] if self.crop else None
        return StreamedDataset.sample(self, i, box)[0]


class EncodedStream(StreamedDataset):
    """StreamedDataset for the GPU's decoder: a JPEG sample as its bytes and crop box in its
    pixels (ShardImages.jpeg_crop; no crop: the whole image as `fit` frames it), any other
    decoded here (its box -1)."""

    def sample(self, i: int, box: Tensor | None) -> tuple[Tensor, Tensor]:
        whole = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
        if (got := self.x.jpeg_crop(i, whole if box is None else box)) is not None:
            return got
        return *super().sample(i, box), torch.full((4,), -1.0, dtype=torch.float64)

    @staticmethod
    def collate(samples: list) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(pixels of the samples decoded here, every JPEG's bytes end to end, their lengths,
        boxes, labels, indices): a few tensors a batch, not one per JPEG, each of which took a
        file descriptor on its way from the worker (`Too many open files` at batch 256)."""
        payloads, boxes, ys, idx = zip(*samples, strict=True)
        boxes = torch.stack(boxes)
        jpegs = [p for p, b in zip(payloads, boxes, strict=True) if b[0] >= 0]
        decoded = [p for p, b in zip(payloads, boxes, strict=True) if b[0] < 0]
        pixels = torch.stack(decoded) if decoded else torch.empty(0, dtype=torch.uint8)
        data = torch.cat(jpegs) if jpegs else torch.empty(0, dtype=torch.uint8)
        return (pixels, data, torch.tensor([len(p) for p in jpegs], dtype=torch.int64), boxes,
                torch.stack(ys), torch.tensor(idx))
