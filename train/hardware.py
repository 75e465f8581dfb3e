"""What a recipe's ``auto`` precision means on this machine (no torch import: the dry run uses it).

Why a rule on the CPU's instructions and not the serving measurement of
:mod:`specfoundry.runtime.autodtype`: training's work is batched (Magpie and response generation
at 48-64 rows, feature capture, the head's forward/backward), and there bfloat16 only pays where
the CPU multiplies it natively. Measured (docs/results.md, eighth session), SmolLM2-135M forwards
on a 2-core AMD EPYC with AVX2 only: bfloat16 took 3.7x (48 rows) to 5.5x (256 tokens) the time of
float32, so the default recipe's Magpie stage alone overran its whole 7-minute data budget; on
the earlier sessions' EPYC with avx512_bf16, bfloat16 autocast ran the training step 1.8x faster
than float32. A single decode row is memory-bound and the serving choice measures it separately.

Rule: on CUDA, ``bf16``; on a CPU, ``bf16`` when it has bfloat16 dot-product instructions
(x86 ``avx512_bf16`` or ``amx_bf16``, Arm ``bf16``), else ``fp32``.
"""

from __future__ import annotations

import functools

__all__ = ["auto_precision", "cpu_has_native_bf16"]

_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU flags (``flags``/``Features`` lines) name a bfloat16 dot-product
    instruction; False where they cannot be read (no /proc: macOS, Windows)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features") and _BF16_FLAGS & set(value.split()):
                    return True
    except OSError:
        pass
    return False


def auto_precision(device: str) -> str:
    """The recipe precision (``"bf16"`` / ``"fp32"``) that ``auto`` resolves to on ``device``
    (``cpu``, ``cuda``, ``cuda:N``, ``mps``)."""
    if device.startswith("cuda"):
        return "bf16"
    if device == "cpu":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return "fp32"
