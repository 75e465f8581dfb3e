"""Measured choices kept per machine, so that every process on it takes the first one's:
:func:`kept`, used by the engine for its kernel choice (``LlamaEngine``).

Why: the engine picks the products it runs on by timing the candidates when it loads, and
candidates whose sums differ in the last bits can swap places on a busy machine. Measured on a
2-core Xeon without AMX (docs/results.md, forty-seventh session): of 40 fresh processes that each
prefilled the same 700 tokens, 4 took the AVX-512 BF16 passes or oneDNN for the many-row products
instead of the fp32 GEMM (more with a second process beside them), so the same prompt gave other
bits (an EAGLE head's tau on the same 10 prompts 1.678 in one process, 1.713 in ten others) and
its prefill ran on a slower kernel. A choice kept per machine makes a run repeat the last one.

A value is stored as JSON in ``cache_dir()/choices/<kind>-<key>.json``, ``key`` a hash of
everything the choice depends on (the caller's ``parts``, plus this CPU's model name, flags and
core count and the torch version), written atomically; a file that cannot be read, or whose value
the caller's ``valid`` rejects, is measured again and replaced. ``SPECFOUNDRY_CHOICES=renew``
measures again and replaces what was kept (after a first measurement on a busy machine);
``SPECFOUNDRY_CHOICES=measure`` measures in every process and keeps nothing (the tests' default:
each test measures what it set up).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .atomic import atomic_write_text
from .native import cpu_flags
from .paths import cache_dir

__all__ = ["CHOICES_ENV", "MODES", "choice_path", "kept"]

#: ``keep`` (default): a choice measured once per machine is read back; ``renew``: measured again and
#: kept; ``measure``: measured in every process, nothing kept
CHOICES_ENV = "SPECFOUNDRY_CHOICES"
MODES = ("keep", "renew", "measure")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def choice_path(kind: str, parts: dict) -> Path:
    """Where the choice ``kind`` for ``parts`` (JSON-serialisable) is kept on this machine."""
    machine = {"cpu": _cpu_model(), "flags": sorted(cpu_flags()), "cores": os.cpu_count(), "torch": torch.__version__}
    blob = json.dumps({"machine": machine, "parts": parts}, sort_keys=True, default=str)
    return cache_dir() / "choices" / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


def kept(kind: str, parts: dict, measure: Callable[[], Any], valid: Callable[[Any], bool] = lambda v: True
         ) -> tuple[Any, str]:
    """``(value, where it came from)``: the value kept for ``kind``/``parts`` on this machine when
    there is a readable one that ``valid`` accepts, else ``measure()``, then kept (JSON: lists come back
    as lists). ``where``: ``"measured"``, ``"measured, kept in <path>"`` or ``"kept in <path>"``."""
    mode = os.environ.get(CHOICES_ENV, "keep")
    if mode not in MODES:
        raise ValueError(f"{CHOICES_ENV}={mode!r}: one of {', '.join(MODES)} (keep is the default)")
    if mode == "measure":
        return measure(), "measured"
    path = choice_path(kind, parts)
    try:
        value = json.loads(path.read_text())["value"] if mode == "keep" else None
        if value is not None and valid(value):
            return value, f"kept in {path}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measured again and replaced
    value = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"kind": kind, "parts": parts, "value": value,
                                            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1, default=str))
    except OSError:
        return value, "measured"  # a read-only cache: this process keeps its own measurement
    return value, f"measured, kept in {path}"
