"""One typed schema for params.yaml, validated once at stage start.

stages/lib/strict_yaml.py reads the YAML (no interpolation, bounded) and OmegaConf builds the
dataclasses; before that, `check_schema` walks the raw YAML against the schema so that a typo, a
wrong type or a quoted number fails naming the key, instead of being silently coerced or ignored.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import resource
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from omegaconf import OmegaConf

from stages.lib.errors import UserError
from stages.lib.paths import repo_root
from stages.lib.strict_yaml import YamlError, read_yaml, refuse_interpolation


def _registry_names(module: str, name: str) -> tuple[str, ...]:
    """The keys of the registry `name`, a dict written out in stages/<module>.py, read from its
    source rather than imported: the registry owns the names (adding a model or a source touches
    that file alone), checking params.yaml still imports no torch (a second of every params
    stage), and the import graph that dvc.yaml's deps come from keeps models.py out of
    prepare's (a model change never reruns prepare)."""
    path = Path(__file__).with_name(f"{module}.py")
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else \
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id == name:
            keys = node.value.keys if isinstance(node.value, ast.Dict) else [None]
            if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
                return tuple(k.value for k in keys)
    raise RuntimeError(f"{path}: `{name}` must be a dict written out with string keys (its "
                       "module docstring says why)")


# The choices of data.source and model.arch: the names in the registries sources.SOURCES and
# models.ARCHS. Those of train.schedule are optim.SCHEDULES's (a test keeps the two equal).
SOURCES = _registry_names("sources", "SOURCES")
ARCHS = _registry_names("models", "ARCHS")
SCHEDULES = ("cosine", "step", "plateau", "constant")

# The pipeline's folders, as dvc.yaml names them (a test checks).
PREPARED = Path("data/prepared")
TRAIN_DIR = Path("models/train")
EVAL_DIR = Path("models/eval")
EXPORT_DIR = Path("models/export")


class ParamsError(UserError, ValueError):
    """A params.yaml problem; the message names the key and says how to fix it."""


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ParamsError(f"params.yaml: {key}={value!r} is invalid: {rule}")


def _choice(key: str, value: Any, choices: tuple) -> None:
    _require(value in choices, key, value, f"choose one of {', '.join(map(str, choices))}")


def _check_workers(key: str, value: Any) -> None:
    _require(value == "auto" or (isinstance(value, int) and value >= 0), key, value,
             "use auto or an integer >= 0")
    if value != "auto" and value > 0:
        bound, why = worker_bound()
        _require(value <= bound, key, value, f"at most {bound} here ({why}); use auto or fewer")


def worker_bound() -> tuple[int, str]:
    """The most worker processes a stage may start on this machine, and why: one per CPU core
    this process may use (more decode nothing faster, and each holds memory of its own:
    PyTorch's DataLoader warns past it too), fewer where the user's process limit (`ulimit -u`)
    leaves less room. 1000 would be forked, and fail part way."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit != resource.RLIM_INFINITY and not machine_root() and \
            limit - (tasks := user_tasks(os.getuid())) < cores:
        return max(0, limit - tasks), f"`ulimit -u` is {limit}, and this user runs {tasks} " \
            "processes and threads already"
    return cores, "the CPU cores this process may use"


def machine_root() -> bool:
    """Root of the machine's own user namespace, whose forks pass `ulimit -u`; root in another
    (a rootless container's) is held to it."""
    try:
        return os.getuid() == 0 and Path("/proc/self/uid_map").read_text().split() == \
            ["0", "0", "4294967295"]
    except OSError:  # not Linux
        return os.getuid() == 0


def user_tasks(uid: int) -> int:
    """The processes and threads whose real user is `uid`: what the kernel counts against
    `ulimit -u`."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):  # ended meanwhile
            continue
    return count


@dataclass
class DataConfig:
    source: str = "digits"
    root: str = "data/raw/digits"
    image_size: int = 16
    channels: Union[int, str] = "auto"  # noqa: UP007 - auto: the source's own (prepare says which)
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    resize: str = "squash"
    num_workers: Union[int, str] = "auto"  # noqa: UP007
    max_rejected_fraction: float = 0.05
    format: str = "auto"
    store_size: int = 256
    shard_mb: int = 128

    @property
    def workers(self) -> int:
        """The decoding processes prepare starts (`auto`: as many as worker_bound allows)."""
        return worker_bound()[0] if self.num_workers == "auto" else self.num_workers

    def __post_init__(self) -> None:
        _choice("data.source", self.source, SOURCES)
        _choice("data.format", self.format, ("auto", "tensors", "shards"))
        _require(self.format != "shards" or self.source == "folder", "data.format", self.format,
                 "only data.source: folder is written as shards; use auto or tensors")
        _require(16 <= self.store_size <= 4096, "data.store_size", self.store_size, "must be 16..4096")
        _require(1 <= self.shard_mb <= 4096, "data.shard_mb", self.shard_mb, "must be 1..4096")
        _choice("data.resize", self.resize, ("squash", "center_crop"))
        _check_workers("data.num_workers", self.num_workers)
        _require(0 <= self.max_rejected_fraction <= 1, "data.max_rejected_fraction",
                 self.max_rejected_fraction, "must be in [0, 1]")
        _require(4 <= self.image_size <= 1024, "data.image_size", self.image_size, "must be 4..1024")
        _require(self.store_size >= self.image_size or self.format == "tensors"
                 or self.source != "folder", "data.store_size", self.store_size,
                 f"below data.image_size {self.image_size}, shards would keep every image smaller "
                 "than training reads it, to be upsampled; set data.store_size to "
                 f"{self.image_size} or more")
        _choice("data.channels", self.channels, (1, 3, "auto"))
        for k in ("val_fraction", "test_fraction"):
            v = getattr(self, k)
            _require(0 < v < 1, f"data.{k}", v, "must be in (0, 1)")
        _require(self.val_fraction + self.test_fraction < 1, "data.val_fraction + data.test_fraction",
                 self.val_fraction + self.test_fraction, "must leave training data (sum < 1)")


@dataclass
class ModelConfig:
    arch: str = "cnn"
    width: int = 32
    dropout: float = 0.1

    def __post_init__(self) -> None:
        _choice("model.arch", self.arch, ARCHS)
        # 1024 is a 140M-parameter cnn: far past what 8-64 px images need, and a bound on what a
        # checkpoint or model.json that names a width can make predict, evaluate or export allocate.
        _require(1 <= self.width <= 1024, "model.width", self.width, "must be 1..1024")
        _require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")


@dataclass
class TrainConfig:
    device: str = "auto"
    precision: str = "auto"
    loader: str = "auto"
    num_workers: Union[int, str] = "auto"  # noqa: UP007 (OmegaConf 2.3 reads typing.Union only)
    device_data_budget_mb: int = 1024
    channels_last: bool = True
    compile: Union[bool, str] = False  # noqa: UP007
    optimizer: str = "adamw"
    weight_decay: float = 0.05
    momentum: float = 0.9
    nesterov: bool = True
    accumulate: int = 1
    clip_grad_norm: float = 1.0
    schedule: str = "cosine"
    warmup_epochs: float = 1.0
    min_lr: float = 0.0
    step_epochs: int = 10
    step_gamma: float = 0.1
    plateau_patience: int = 2
    plateau_factor: float = 0.5
    label_smoothing: float = 0.0
    ema: bool = False
    ema_decay: float = 0.999
    early_stopping_patience: int = 0
    overfit_batches: int = 0
    augment_crop_pad: int = 1
    augment_hflip: bool = False
    # A random-resized crop's area (a fraction of the image) and aspect (width/height) ranges,
    # torchvision's RandomResizedCrop's scale and ratio; area [1, 1]: off.
    augment_crop_scale: list[float] = field(default_factory=lambda: [1.0, 1.0])
    augment_crop_ratio: list[float] = field(default_factory=lambda: [0.75, 1.3333333333333333])
    log_every: int = 50
    deterministic: bool = True
    resume: str = "auto"
    checkpoint_dir: str = ".checkpoints"
    nproc_per_node: Union[int, str] = 1  # noqa: UP007

    def __post_init__(self) -> None:
        _require(re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device) is not None,
                 "train.device", self.device, "use auto, cpu, cuda, cuda:N (N a GPU index) or mps")
        _choice("train.precision", self.precision, ("auto", "fp32", "bf16", "fp16"))
        _choice("train.loader", self.loader, ("auto", "device", "dataloader", "stream"))
        _check_workers("train.num_workers", self.num_workers)
        _require(self.compile in (True, False, "default", "reduce-overhead", "max-autotune",
                                  "max-autotune-no-cudagraphs"), "train.compile", self.compile,
                 "use false, true or a torch.compile mode such as max-autotune")
        # torch.use_deterministic_algorithms turns on Inductor's deterministic mode, which picks
        # the eager kernels instead of autotuning: the mode would silently do nothing.
        _require(not (self.deterministic and str(self.compile).startswith("max-autotune")),
                 "train.compile", self.compile, "autotuning is off under train.deterministic: "
                 "true (Inductor then picks eager kernels); set train.deterministic: false to "
                 "autotune, or train.compile: true")
        _choice("train.optimizer", self.optimizer, ("adamw", "sgd"))
        _choice("train.schedule", self.schedule, SCHEDULES)
        _choice("train.resume", self.resume, ("auto", "never"))
        _require(self.nproc_per_node == "auto" or (isinstance(self.nproc_per_node, int)
                 and self.nproc_per_node >= 1), "train.nproc_per_node", self.nproc_per_node,
                 "use auto (one process per visible GPU) or an integer >= 1")
        _require(self.accumulate >= 1, "train.accumulate", self.accumulate, "must be >= 1")
        for k in ("weight_decay", "clip_grad_norm", "warmup_epochs", "min_lr", "early_stopping_patience",
                  "overfit_batches", "augment_crop_pad", "device_data_budget_mb"):
            _require(getattr(self, k) >= 0, f"train.{k}", getattr(self, k), "must be >= 0 (0 turns it off)")
        for k in ("momentum", "label_smoothing", "ema_decay"):
            _require(0 <= getattr(self, k) < 1, f"train.{k}", getattr(self, k), "must be in [0, 1)")
        scale, ratio = self.augment_crop_scale, self.augment_crop_ratio
        _require(len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1, "train.augment_crop_scale",
                 scale, "give [min, max] areas with 0 < min <= max <= 1 ([1.0, 1.0]: off)")
        _require(len(ratio) == 2 and 0 < ratio[0] <= ratio[1], "train.augment_crop_ratio", ratio,
                 "give [min, max] aspect ratios (width/height) with 0 < min <= max")
        _require(0 < self.step_gamma <= 1, "train.step_gamma", self.step_gamma, "must be in (0, 1]")
        _require(0 < self.plateau_factor < 1, "train.plateau_factor", self.plateau_factor,
                 "must be in (0, 1)")
        _require(self.step_epochs >= 1, "train.step_epochs", self.step_epochs, "must be >= 1")
        _require(self.plateau_patience >= 1, "train.plateau_patience", self.plateau_patience,
                 "must be >= 1")
        _require(self.log_every >= 1, "train.log_every", self.log_every, "must be >= 1")


@dataclass
class EvalConfig:
    batch_size: int = 512
    misclassified_max: int = 36

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, "eval.batch_size", self.batch_size, "must be >= 1")
        _require(self.misclassified_max >= 0, "eval.misclassified_max", self.misclassified_max,
                 "must be >= 0")


MAX_EXPORT_BATCH = 65536  # the exported programs' largest batch (stages/export.py)


@dataclass
class ExportConfig:
    opset: int = 18
    check_batch_sizes: list[int] = field(default_factory=lambda: [1, 7])
    atol: float = 1e-4
    log_model: bool = True  # false: export logs no model, so registers none either
    register_as: str = "reprotrain"  # registered model: alias candidate (champion if best); "": none

    def __post_init__(self) -> None:
        # torch.onnx writes opset 18 and newer; asked for 17 it tries onnx's converter, which
        # fails on this project's models and leaves 18 in the file.
        _require(self.opset >= 18, "export.opset", self.opset,
                 "must be >= 18, the oldest opset torch.onnx writes")
        _require(len(self.check_batch_sizes) >= 2 and len(set(self.check_batch_sizes)) >= 2
                 and all(1 <= b <= MAX_EXPORT_BATCH for b in self.check_batch_sizes),
                 "export.check_batch_sizes", self.check_batch_sizes,
                 f"give at least two different batch sizes from 1 to {MAX_EXPORT_BATCH}")
        _require(self.atol > 0, "export.atol", self.atol, "must be > 0")


@dataclass
class MlflowConfig:
    experiment: str = "reprotrain"
    tracking_uri: str = ""  # empty: sqlite:///<repo root>/mlflow.db; MLFLOW_TRACKING_URI wins

    def __post_init__(self) -> None:
        _require(bool(self.experiment.strip()), "mlflow.experiment", self.experiment,
                 "must be a non-empty name")
        uri = urllib.parse.urlsplit(self.tracking_uri)
        # Params are logged to MLflow and committed with git: a password there is everyone's.
        _require(uri.password is None, "mlflow.tracking_uri",
                 uri._replace(netloc=uri.netloc.rpartition("@")[2]).geturl(),
                 "remove user:password@ from it and set MLFLOW_TRACKING_USERNAME and "
                 "MLFLOW_TRACKING_PASSWORD in the environment instead")


# A bound on what a typo or a sweep's range (`high: 1e20`) can ask: months of training that no
# one meant. Far above any real training of this project's data.
MAX_EPOCHS = 10_000


@dataclass
class Params:
    seed: int = 42
    lr: float = 3e-3
    epochs: int = 30
    batch_size: int = 64
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def __post_init__(self) -> None:
        # numpy and scikit-learn take seeds below 2**32 only (torch's limit is higher).
        _require(0 <= self.seed < 2**32, "seed", self.seed, "must be in 0..4294967295 (2**32 - 1)")
        _require(self.lr > 0, "lr", self.lr, "must be > 0 (try 3e-3 for adamw, 0.1 for sgd)")
        _require(1 <= self.epochs <= MAX_EPOCHS, "epochs", self.epochs, f"must be >= 1 and <= {MAX_EPOCHS}")
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        if self.train.nproc_per_node != "auto":  # auto is counted on the machine that trains
            batch_share(self.batch_size, self.train.nproc_per_node,
                        f"train.nproc_per_node={self.train.nproc_per_node}")


def batch_share(batch_size: int, processes: int, what: str) -> int:
    """Each process's part of the global batch: the one place the rule lives (checked with the
    params, when `auto` is counted, and when the training group has formed). `what` names the
    processes for the message."""
    _require(batch_size % processes == 0, "batch_size", batch_size,
             f"must be a multiple of {what}: each process takes an equal share of the global batch")
    return batch_size // processes


def _accepts(tp: Any, value: Any) -> bool:
    """Strict type check: no str->number coercion, no bool as int; an int is a valid float."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_accepts(t, value) for t in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    return " or ".join(_type_name(a) for a in args) if args and typing.get_origin(tp) is not list \
        else getattr(tp, "__name__", str(tp))


def unknown_key(where: str, key: str, known: list[str], prefix: str = "") -> str:
    """The line for a key that is none of `known` (in the order given): the known key it is
    closest to, or all of them. params.yaml, model.json's model_params and a sweep file say it
    alike."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {prefix + close[0]!r}?" if close else \
        f"known keys: {', '.join(prefix + k for k in known)}"
    return f"{where}: unknown key {prefix + key!r}; {hint}"


def check_schema(raw: dict, schema: type, prefix: str = "") -> None:
    """`raw`'s keys and value types against a dataclass of this schema (`prefix`: its section),
    before any value is converted; the ranges are the dataclass's own __post_init__."""
    hints = typing.get_type_hints(schema)
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in hints:
            raise ParamsError(unknown_key("params.yaml", str(key), list(hints), prefix))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ParamsError(f"params.yaml: {name!r} must be a section (a mapping), "
                                  f"got {value!r}")
            check_schema(value, tp, f"{name}.")
        elif not _accepts(tp, value):
            quoted = " (remove the quotes)" if isinstance(value, str) and tp in (int, float) \
                and _number(value, tp) else ""
            raise ParamsError(f"params.yaml: {name}={value!r} must be {_type_name(tp)}, "
                              f"not {type(value).__name__}{quoted}")
        elif isinstance(value, float) and not math.isfinite(value):
            # .inf passes every `>= 0` range check, then breaks the schedule or the loss later.
            raise ParamsError(f"params.yaml: {name}={value!r} must be a finite number")


def _number(text: str, tp: type) -> bool:
    """Whether `text` reads as a `tp`: then the value was a number in quotes."""
    try:
        tp(text)
    except ValueError:
        return False
    return True


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: not found; run from the repository root")
    raw = read_params(path)
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of keys to values")
    try:
        return check_params(raw, path)
    except ParamsError as e:
        # A workspace `dvc exp run -S` leaves its value in params.yaml even when it fails, and
        # every later `dvc repro` would fail on it too. (Git sees the change: stages.lib.cli
        # re-stats what DVC's stash left with stale times in git's index.)
        if os.environ.get("DVC_EXP_NAME") and Path.cwd().resolve() == repo_root():
            # "did you mean 'lr'?" already ends a sentence.
            end = " " if str(e).endswith("?") else ". "
            raise ParamsError(f"{e}{end}`dvc exp run -S` wrote this value into {path}: correct "
                              f"or remove that line (or `git checkout -- {path}` for the committed "
                              "values, which also drops an applied experiment's), then `dvc "
                              "repro` the outputs DVC removed (from its run-cache)") from None
        raise


def check_params(raw: dict, path: str | Path = "params.yaml") -> Params:
    """params.yaml's mapping (plain containers) checked against the schema: keys, types, then
    every range; also for values that are not in a file yet (a sweep's)."""
    try:
        refuse_interpolation(raw, Path(path))
    except YamlError as e:
        raise ParamsError(str(e)) from None
    check_schema(raw, Params)
    merged = OmegaConf.merge(OmegaConf.structured(Params), raw)
    return OmegaConf.to_object(merged)  # runs every __post_init__ range check


def read_params(path: Path) -> Any:
    """A params file's YAML as plain containers (stages/lib/strict_yaml.py), unchecked; its
    problems are ParamsErrors."""
    try:
        return read_yaml(path)
    except YamlError as e:
        raise ParamsError(str(e)) from None


def flatten(params: Params | dict) -> dict[str, Any]:
    """`train.lr`-style keys, one name per concept from YAML to MLflow (of the checked params,
    or of a raw params.yaml mapping)."""
    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(params if isinstance(params, dict) else dataclasses.asdict(params), "")
    return out


def params_hash(values: dict[str, Any], *extra: str) -> str:
    blob = json.dumps(values, sort_keys=True, default=str) + "".join(extra)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
