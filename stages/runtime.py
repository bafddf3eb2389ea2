"""Where the code runs: device, precision, backend switches, peak memory, and inference.

Training, evaluation, export checks and the bench all use these; none of them needs the loop.
"""

from __future__ import annotations

import os
import platform
import re
import resource
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from stages.config import ParamsError
from stages.data import normalize

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`auto`: CUDA, else MPS, else the CPU. Under torchrun each process takes its own GPU."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ParamsError(f"params.yaml: train.device={name!r} but CUDA is not available on "
                          "this machine; use auto or cpu")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ParamsError(f"params.yaml: train.device={name!r} but this machine has "
                          f"{torch.cuda.device_count()} GPU(s), numbered from 0")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ParamsError("params.yaml: train.device='mps' but MPS (Apple GPUs, macOS) is not "
                          "available here; use auto or cpu")
    device = torch.device(name) if name != "auto" else \
        torch.device("cuda") if torch.cuda.is_available() else \
        torch.device("mps") if torch.backends.mps.is_available() else torch.device("cpu")
    if device.type == "cuda" and local_rank is not None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index is not None and \
            int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # Current as well as named (torchrun's processes made their own current at init): CUDA
        # work that names no device, as the NaN guard's event and the pin-memory thread's
        # context, would go to GPU 0 beside it.
        torch.cuda.set_device(device)
    return device


def cpu_has_bf16() -> bool:
    """AMX or AVX512-BF16: the CPUs where bf16 autocast runs native kernels rather than emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_name() -> str:
    try:
        return re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or platform.machine()


def made_on(device: torch.device, processes: int = 1) -> dict:
    """What decides a run's last bits beyond the code, params and requirements.lock that DVC
    hashes: the GPU, or the CPU (its name, which a VM may leave generic, and whether it has
    bf16, which `precision: auto` follows) and torch's thread count (of each of `processes`).
    Not a dependency, so that a teammate's run-cache still restores here; recorded instead, and
    `make repro` compares."""
    if device.type == "cuda":
        return {"gpu": torch.cuda.get_device_name(device)}
    return {"cpu": cpu_name(), "bf16": cpu_has_bf16(), "threads": torch.get_num_threads()} \
        | ({"processes": processes} if processes > 1 else {})


def resolve_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        # Native bf16 only (Ampere and later): T4 and V100 emulate it slowly, and get fp16 with
        # loss scaling instead.
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    if device.type == "cpu" and cpu_has_bf16():
        return "bf16"
    return "fp32"


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """Convs and matmuls in bf16/fp16, reductions in fp32; a no-op in fp32."""
    return torch.autocast(device.type, AMP_DTYPES.get(precision, torch.float32),
                          enabled=precision in AMP_DTYPES)


def set_backends(deterministic: bool) -> None:
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: a CUDA op without a deterministic kernel warns instead of killing the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        # ...but not its NaN-filling of every torch.empty, a debugging aid that costs a tenth of
        # a CPU step (profiled); no kernel we use reads memory it did not write.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True
    # cudnn.benchmark picks the fastest conv algorithm per shape, but that choice is not repeatable.
    torch.backends.cudnn.benchmark = not deterministic
    # TF32 matmuls on Ampere+: several times fp32's throughput for a 10-bit mantissa, harmless
    # for training.
    torch.set_float32_matmul_precision("high")


def reset_peak_mem(device: torch.device) -> bool:
    """Start a new peak-memory window for `peak_mem_mb`; False where the platform cannot, and
    the CPU figure is then the process's lifetime peak."""
    if device.type == "cuda":
        torch.cuda.init()  # resetting the statistics of a device CUDA has not set up yet fails
        torch.cuda.reset_peak_memory_stats(device)
        return True
    # On the CPU the kernel keeps the resident high-water mark itself (VmHWM); writing 5 to
    # clear_refs restarts it: exact, free, and no sampling thread competing with the compute.
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def proc_status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB; None off Linux."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith(key + ":")), None)


def peak_mem_mb(device: torch.device) -> float:
    """Peak memory since `reset_peak_mem`: CUDA's allocated bytes, the CPU's resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm = proc_status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@torch.inference_mode()
def predict(model: nn.Module, batches: Iterable[Tensor], mean: Tensor, std: Tensor, *,
            device: torch.device, precision: str = "fp32", channels_last: bool = False) -> Tensor:
    """Logits (float32, on the CPU) for a whole split, in order, from its `in_batches`."""
    model.eval()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = []
    for x in batches:
        x = x.to(device, non_blocking=True)
        x = normalize(x, mean, std).contiguous(memory_format=fmt)
        with autocast(device, precision):
            # A copy, not the output itself: a CUDA-graph replay (compile: reduce-overhead)
            # reuses its output memory for the next batch.
            out.append(model(x).to(torch.float32, copy=True))
    return torch.cat(out).cpu()
