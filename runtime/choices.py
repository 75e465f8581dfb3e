"""Measured choices kept per machine, so that every process on it takes the first one's:
:func:`kept`, used by the engine for its kernel choice (``LlamaEngine``).

Why: the engine picks the products it runs on by timing the candidates when it loads, and
candidates whose sums differ in the last bits can swap places between processes. Measured on a
2-core Xeon without AMX (docs/results.md, forty-seventh session): of 74 fresh processes prefilling
the same 700 tokens on the quiet machine, 1 chose the AVX-512 BF16 passes for the many-row products
instead of the fp32 GEMM (5 of 28 with other processes running), and that prefill gave other bits
(the forty-sixth session saw a head's tau on the same 10 prompts at 1.678 in one process of eleven,
1.713 in the others) and ran 1.2-1.5x slower. Kept, every later process takes the first one's choice.

A value is stored as JSON in ``cache_dir()/choices/<kind>-<key>.json``, ``key`` a hash of
everything the choice depends on (the caller's ``parts``, plus this CPU's model name, flags and
core count and the torch version), written atomically; a file that cannot be read, or whose value
the caller's ``valid`` rejects, is measured again and replaced. A measurement during which other
processes kept the cores busy (:data:`BUSY_CORES`, from ``/proc/stat``) is used, not kept: the next
process measures again. ``SPECFOUNDRY_CHOICES=renew`` measures again and replaces what was kept;
``SPECFOUNDRY_CHOICES=measure`` measures in every process and keeps nothing (the tests' default:
each test measures what it set up). A file read back is touched, and keeping a new value removes
the same kind's files unused for :data:`UNUSED_DAYS` (keys an upgrade, another thread count or model
left behind), so the directory holds what is in use.
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
from .native import cpu_flags, cpu_info
from .paths import cache_dir

__all__ = ["BUSY_CORES", "CHOICES_ENV", "MODES", "UNUSED_DAYS", "choice_path", "kept"]

#: ``keep`` (default): a choice measured once per machine is read back; ``renew``: measured again and
#: kept; ``measure``: measured in every process, nothing kept
CHOICES_ENV = "SPECFOUNDRY_CHOICES"
MODES = ("keep", "renew", "measure")
#: a measurement during which other processes kept more cores than this busy (on average) is used but not
#: kept: on a 2-core Xeon a busy loop on one core beside the engine's kernel choice made 7 of 16 loads
#: choose another many-row kernel, against 0 of 16 on the quiet machine (forty-seventh session)
BUSY_CORES = 0.5

#: a kept choice not read for this long is removed when another of its kind is kept
UNUSED_DAYS = 60


def _busy_seconds() -> tuple[float, float, float] | None:
    """(CPU seconds every process has used, this process's, wall clock) now; None where /proc/stat is
    unreadable. Steal time counts as used: a hypervisor's other guests slow a measurement too."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = os.times()
    # (its children too: a kernel this process compiles while it measures is its own work)
    mine = own.user + own.system + own.children_user + own.children_system
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), mine, time.monotonic()


def _others_cores(before: tuple[float, float, float] | None) -> float:
    """Cores other processes kept busy on average since ``before`` (:func:`_busy_seconds`); 0 where unknown
    or under a quarter second (/proc/stat counts in 10 ms ticks per CPU: a measurement that times
    nothing, e.g. one candidate only, read as 5 cores busy on a 2-core machine)."""
    after = _busy_seconds()
    if before is None or after is None or after[2] - before[2] < 0.25:
        return 0.0
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / (after[2] - before[2])


def choice_path(kind: str, parts: dict) -> Path:
    """Where the choice ``kind`` for ``parts`` (JSON-serialisable) is kept on this machine."""
    machine = {"cpu": cpu_info("model name") or platform.processor() or platform.machine(),
               "flags": sorted(cpu_flags()), "cores": os.cpu_count(), "torch": torch.__version__}
    blob = json.dumps({"machine": machine, "parts": parts}, sort_keys=True, default=str)
    return cache_dir() / "choices" / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


def kept(kind: str, parts: dict, measure: Callable[[], Any], valid: Callable[[Any], bool] = lambda v: True
         ) -> tuple[Any, str]:
    """``(value, where it came from)``: the value kept for ``kind``/``parts`` on this machine when
    there is a readable one that ``valid`` accepts, else ``measure()``, then kept (JSON: lists come back
    as lists). ``where``: ``"measured"``, ``"measured, kept in <path>"``, ``"measured, not kept: ..."``
    (a busy machine) or ``"kept in <path>"``."""
    mode = os.environ.get(CHOICES_ENV, "keep")
    if mode not in MODES:
        raise ValueError(f"{CHOICES_ENV}={mode!r}: one of {', '.join(MODES)} (keep is the default)")
    if mode == "measure":
        return measure(), "measured"
    path = choice_path(kind, parts)
    try:
        value = json.loads(path.read_text())["value"] if mode == "keep" else None
        if value is not None and valid(value):
            _touch(path)
            return value, f"kept in {path}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measured again and replaced
    before = _busy_seconds()
    value = measure()
    others = _others_cores(before)
    if others > BUSY_CORES:
        return value, f"measured, not kept: other processes kept {others:.1f} cores busy meanwhile"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"kind": kind, "parts": parts, "value": value,
                                            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1, default=str))
    except OSError:
        return value, "measured"  # a read-only cache: this process keeps its own measurement
    _prune(kind, path)
    return value, f"measured, kept in {path}"


def _touch(path: Path) -> None:
    """Mark ``path`` used now (its mtime: what :func:`_prune` goes by)."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache: nothing is pruned there either


def _prune(kind: str, keep: Path) -> None:
    """Remove ``kind``'s files other than ``keep`` unused for :data:`UNUSED_DAYS`."""
    cutoff = time.time() - UNUSED_DAYS * 86400
    for old in keep.parent.glob(f"{kind}-{'[0-9a-f]' * 20}.json"):  # not another kind that starts with this one
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass  # gone already (another process pruned it) or not ours to remove
