"""What a recipe's ``auto`` precision means on this machine (no torch import: the dry run uses it).

Why a rule on the CPU's instructions and not the serving measurement of
:mod:`specfoundry.runtime.autodtype`: training's work is batched (Magpie and response generation
at 48-64 rows, feature capture, the head's forward/backward), and there bfloat16 only pays where
the CPU multiplies it natively. Measured (docs/results.md, eighth session), SmolLM2-135M forwards
on a 2-core AMD EPYC with AVX2 only: bfloat16 took 3.7x (48 rows) to 5.5x (256 tokens) the time of
float32, so the default recipe's Magpie stage alone overran its whole 7-minute data budget; on
the earlier sessions' EPYC with avx512_bf16, bfloat16 autocast ran the training step 1.8x faster
than float32. A single decode row is memory-bound and the serving choice measures it separately.

Rule for the target's weights (``target.dtype``, the responses' dtype): on CUDA, ``bf16``; on a CPU,
``bf16`` when it has bfloat16 dot-product instructions (x86 ``avx512_bf16`` or ``amx_bf16``, Arm
``bf16``), else ``fp32`` (the runtime engine then picks its own kernels per product by measurement).

Rule for the training step (``training.precision``): as above, except on an Intel CPU without AMX, where
the head's forward/backward runs in float32. There ``vdpbf16ps`` retires at half a float32 FMA's rate
(Sapphire / Emerald Rapids, thirty-fifth session), so a bfloat16 product does the float32 one's work
plus the casts: the default recipe's step on the same 640 cached examples took 1.74 s in bfloat16
autocast against 1.01 s in float32 on a 2-core Emerald Rapids without AMX (forty-fourth session). AMD's
AVX-512 BF16 (Zen 4+) and AMX run it faster in bfloat16 (1.8x, the EPYC above).
"""

from __future__ import annotations

import functools

__all__ = ["auto_precision", "auto_training_precision", "cpu_has_native_bf16", "cpu_bf16_products_pay"]

_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.lru_cache(maxsize=4)
def _cpu_fields(cpuinfo: str) -> tuple[str, frozenset[str]]:
    """(``vendor_id``, the union of the ``flags``/``Features`` lines) of a cpuinfo file; empty where it
    cannot be read (no /proc: macOS, Windows)."""
    vendor, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        pass
    return vendor, frozenset(flags)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU flags (``flags``/``Features`` lines) name a bfloat16 dot-product
    instruction; False where they cannot be read."""
    return bool(_BF16_FLAGS & _cpu_fields(cpuinfo)[1])


def cpu_bf16_products_pay(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when batched bfloat16 products beat float32 ones on this CPU (the module's rule): native
    bfloat16, and on Intel (``vendor_id`` GenuineIntel) only with AMX (``amx_bf16``)."""
    vendor, flags = _cpu_fields(cpuinfo)
    return bool(_BF16_FLAGS & flags) and (vendor != "GenuineIntel" or "amx_bf16" in flags)


def auto_precision(device: str) -> str:
    """The precision (``"bf16"`` / ``"fp32"``) that ``target.dtype: auto`` (and the responses'
    dtype) resolves to on ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``)."""
    if device.startswith("cuda"):
        return "bf16"
    if device == "cpu":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return "fp32"


def auto_training_precision(device: str) -> str:
    """The precision that ``training.precision: auto`` resolves to on ``device``: as
    :func:`auto_precision`, but on a CPU ``bf16`` only where :func:`cpu_bf16_products_pay`."""
    if device == "cpu":
        return "bf16" if cpu_bf16_products_pay() else "fp32"
    return auto_precision(device)
