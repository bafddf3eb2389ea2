"""The fork points' contracts, checked for every entry of their registries: each model in
models.ARCHS and each data source in sources.SOURCES (the rules are in those modules'
docstrings). A new model or source is checked here without editing this file."""

from __future__ import annotations

import copy
import io
import json
import struct

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save

from stages import models, sources, weights
from stages.config import DataConfig, ExportConfig, ModelConfig
from stages.data import SPLITS
from stages.export import check_close, export_program, onnx_bytes, pt2_bytes
from stages.lib.files import atomic_write_all
from stages.lib.images import DataError
from stages.models import build_model, described, fill, output_key, skeleton, weights_mismatch
from stages.sources import build_meta, content_hash
from tests.support.image_files import make_folder

CHANNELS, CLASSES, SIZE = 3, 7, 8


def built(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(arch=arch, width=4), CHANNELS, CLASSES, SIZE)


def images(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, CHANNELS, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def settled(model: torch.nn.Module) -> torch.nn.Module:
    """In eval mode, with BatchNorm statistics that are not the initial 0 and 1, so that a
    rebuild that lost a buffer shows."""
    with torch.no_grad():
        model.train()(images(8, seed=2) * 3 + 1)
    return model.eval()


@pytest.mark.parametrize("arch", list(models.ARCHS))
def test_a_seed_builds_the_same_weights_and_the_model_classifies(arch):
    a, b = built(arch), built(arch)
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert all(isinstance(v, torch.Tensor) for v in a.state_dict().values())
    with torch.no_grad():
        logits = a.eval()(images(2))
    assert logits.shape == (2, CLASSES) and logits.dtype == torch.float32
    save({k: v.contiguous() for k, v in a.state_dict().items()})  # no tensor shares memory


@pytest.mark.parametrize("arch", list(models.ARCHS))
def test_it_builds_on_meta_and_its_last_tensor_is_the_output_bias(arch):
    """predict names a class-count mismatch by the last tensor of the architecture."""
    net = skeleton(ModelConfig(arch=arch, width=4), CHANNELS, CLASSES, SIZE)
    assert all(t.is_meta for t in net.state_dict().values())  # built without memory
    model = settled(built(arch))
    assert weights_mismatch(net, described(model.state_dict())) is None
    key = output_key(net)
    assert key == list(model.state_dict())[-1] and net.state_dict()[key].shape == (CLASSES,)
    x = images(3)
    with torch.no_grad():
        before = model(x)
        model.state_dict()[key][4] += 1.0  # the output layer's bias moves class 4's logit alone
        shift = model(x) - before
    assert torch.allclose(shift[:, 4], torch.ones(3), atol=1e-5)
    assert torch.allclose(shift[:, [0, 1, 2, 3, 5, 6]], torch.zeros(3, 6), atol=1e-5)


@pytest.mark.parametrize("arch", list(models.ARCHS))
def test_onnx_and_torch_export_agree_with_eager_at_two_batch_sizes(arch):
    cfg = ExportConfig()
    model = settled(built(arch))
    x = images(max(cfg.check_batch_sizes))
    program = export_program(model, x[:2])  # as export does: batch 2, dynamic
    session = ort.InferenceSession(onnx_bytes(program, cfg.opset), providers=["CPUExecutionProvider"])
    reloaded = torch.export.load(io.BytesIO(pt2_bytes(program))).module()
    diffs = check_close("onnx", lambda b: session.run(None, {"image": b.numpy()})[0], model, x,
                        cfg.check_batch_sizes, cfg.atol)
    diffs |= check_close("pt2", lambda b: reloaded(b).detach().numpy(), model, x,
                         cfg.check_batch_sizes, cfg.atol)
    assert len(diffs) == 2 * len(cfg.check_batch_sizes) and max(diffs.values()) <= 1e-4


@pytest.mark.parametrize("arch", list(models.ARCHS))
def test_rebuilt_from_its_params_alone_it_gives_the_same_outputs(arch, tmp_path):
    """As evaluate and export rebuild it (model.pt) and predict does (model.json)."""
    cfg = ModelConfig(arch=arch, width=4)
    model = settled(built(arch))
    meta = {"classes": [f"c{i}" for i in range(CLASSES)], "mean": [0.5] * CHANNELS,
            "std": [0.25] * CHANNELS, "channels": CHANNELS, "image_size": SIZE, "resize": "squash"}
    atomic_write_all(weights.writes(tmp_path / "model.pt", model, cfg, meta, best_epoch=1))
    from_file, trained = weights.load(tmp_path / "model.pt")
    spec = json.loads(json.dumps(trained.spec()))  # model.json's round trip
    from_json = fill(skeleton(ModelConfig(**spec["model_params"]), spec["input_shape"][0],
                              len(spec["classes"]), spec["input_shape"][1]), model.state_dict())
    x = images(5)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(from_file(x), want) and torch.equal(from_json(x), want)


def test_resnet18_takes_imagenet_stem_at_large_sizes_and_rebuilds_with_it(tmp_path):
    """From IMAGENET_STEM_FROM px the 7x7 stride-2 stem and max-pool: layer1 works at a quarter
    of the side (a sixteenth of the FLOPs); evaluate and predict rebuild it from model.pt."""
    cfg, size = ModelConfig(arch="resnet18", width=4), models.IMAGENET_STEM_FROM
    torch.manual_seed(0)
    large = settled(build_model(cfg, CHANNELS, CLASSES, size))
    small = skeleton(cfg, CHANNELS, CLASSES, size - 1)
    assert (large.conv1.kernel_size, large.conv1.stride) == ((7, 7), (2, 2))
    assert (small.conv1.kernel_size, small.conv1.stride) == ((3, 3), (1, 1))
    x = torch.randn(2, CHANNELS, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stem = large.maxpool(large.relu(large.bn1(large.conv1(x))))
    assert stem.shape[-2:] == (size // 4, size // 4)
    meta = {"classes": [f"c{i}" for i in range(CLASSES)], "mean": [0.5] * CHANNELS,
            "std": [0.25] * CHANNELS, "channels": CHANNELS, "image_size": size, "resize": "squash"}
    atomic_write_all(weights.writes(tmp_path / "model.pt", large, cfg, meta, best_epoch=1))
    from_file, _ = weights.load(tmp_path / "model.pt")
    with torch.no_grad():
        assert torch.equal(from_file(x), large(x))
    gray = skeleton(cfg, 1, CLASSES, size)  # one channel: its own 7x7 stem
    assert gray.conv1.weight.shape == (64, 1, 7, 7)


@pytest.mark.parametrize("arch", list(models.ARCHS))
def test_every_parameter_learns_and_the_model_survives_the_loops_wrappers(arch):
    """DDP wants a gradient for every parameter; EMA deep-copies; training runs channels_last."""
    model = built(arch).train().to(memory_format=torch.channels_last)
    x = images(4).to(memory_format=torch.channels_last)
    torch.nn.functional.cross_entropy(model(x), torch.arange(4)).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert torch.equal(twin(x), model.eval()(x))


def _idx(path, array: np.ndarray) -> None:
    """The IDX format MNIST ships in (uint8 data), uncompressed as torchvision keeps it."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim)
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.tobytes())


def _mnist_files(folder: str):
    def write(root):
        raw = root / folder / "raw"
        raw.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for prefix, n in (("train", 100), ("t10k", 30)):
            _idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
            _idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8) % 10)
    return write


# The raw data a source reads, written small: a source missing here runs on an empty data.root
# (as digits, which ships with scikit-learn). Torchvision checks CIFAR-10's files against their
# MD5s, so no file written here passes: its offline message is what can be checked.
RAW = {"folder": lambda root: make_folder(root, per_class=10, bad=False),
       "mnist": _mnist_files("MNIST"), "fashion_mnist": _mnist_files("FashionMNIST")}
OFFLINE_ONLY = {"cifar10"}


@pytest.mark.parametrize("source", list(sources.SOURCES))
def test_a_source_gives_deterministic_uint8_splits_of_the_asked_shape(source, tmp_path, monkeypatch):
    root = tmp_path / "raw"
    root.mkdir()
    closed = "http://127.0.0.1:9"  # nothing listens there: a download fails at once
    monkeypatch.setenv("http_proxy", closed)
    monkeypatch.setenv("https_proxy", closed)
    if source in OFFLINE_ONLY:
        with pytest.raises(DataError, match=f"Offline\\?.*{root}"):
            sources.SOURCES[source](DataConfig(source=source, root=str(root)), 0, tmp_path / "s")
        return
    RAW.get(source, lambda _: None)(root)
    for channels, size in ((1, 12), (3, 8)):
        cfg = DataConfig(source=source, root=str(root), channels=channels, image_size=size)
        loaded = sources.SOURCES[source](cfg, 7, tmp_path / f"s{channels}")
        classes = loaded.classes
        assert len(classes) >= 2 and len(set(classes)) == len(classes)
        assert all(isinstance(c, str) for c in classes)
        assert list(loaded.splits) == list(SPLITS)
        for name, split in loaded.splits.items():
            assert split.x.dtype == torch.uint8 and split.y.dtype == torch.int64, name
            assert split.x.shape[1:] == (channels, size, size), name
            assert split.y.shape == (len(split.x),) and len(split.x) > 0, name
            assert 0 <= int(split.y.min()) and int(split.y.max()) < len(classes), name
        assert set(loaded.splits["train"].y.tolist()) == set(range(len(classes)))
        build_meta(loaded.splits, classes, cfg)  # prepare's next step
    again = sources.SOURCES[source](cfg, 7, tmp_path / "again")  # a scratch of its own: the
    assert content_hash(again.splits) == content_hash(loaded.splits)  # first maps its files
    assert again.classes == loaded.classes
