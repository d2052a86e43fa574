"""Mixed precision chosen per device, and the device's measured matmul peak (for MFU)."""

from __future__ import annotations

import functools
import time
import warnings

import torch

# Measured on the build machines (AVX2 + FMA, no AVX512-BF16, no AMX): 512x512 matrix
# products ran ~60x slower in bf16 than in fp32 (1.4 vs 85 GFLOP/s on 2 threads).
BF16_CPU_SLOWDOWN = "bf16 matrix products ran ~60x slower than fp32 on a CPU without AVX512-BF16/AMX (measured: 1.4 vs 85 GFLOP/s)"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AMX-BF16 or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def resolve_precision(requested: str, device: torch.device) -> str:
    """`auto` → bf16 on GPUs that have it, fp16 (dynamic loss scaling) on older GPUs,
    bf16 on CPUs with native bf16 units, fp32 elsewhere. Explicit choices are kept;
    an explicit bf16 on a CPU without native bf16 warns once with the measured reason."""
    if device.type == "cuda":
        if requested == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return requested
    native = cpu_has_native_bf16()
    if requested == "auto":
        return "bf16" if native else "fp32"
    if requested == "bf16" and not native:
        _warn_once(f"train.precision=bf16 on this CPU will be slow: {BF16_CPU_SLOWDOWN}. Use precision auto or fp32.")
    if requested == "fp16":
        _warn_once("train.precision=fp16 on a CPU: fp16 matrix products are emulated and slow; use auto or fp32.")
    return requested


def torch_dtype(precision: str) -> torch.dtype:
    return _DTYPES[precision]


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    print(f"WARNING: {message}", flush=True)


@functools.lru_cache(maxsize=None)
def measured_peak_flops(device_type: str, precision: str) -> float:
    """FLOP/s of a square matmul in `precision` on this device, measured for ~0.3 s.

    MFU divides achieved model FLOP/s by this: a peak measured on the same device and
    thread count, not a datasheet number.
    """
    dtype = _DTYPES[precision]
    if device_type == "cuda":
        n, device = 8192, torch.device("cuda")
    else:
        n, device = 1024, torch.device("cpu")
        dtype = torch.float32 if precision != "bf16" else dtype
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm up
    _sync(device_type)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        torch.matmul(a, b)
        iters += 1
    _sync(device_type)
    return 2 * n**3 * iters / (time.perf_counter() - start)


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()
