"""``dtype="auto"``: serve in the dtype whose plain decoding is fastest on this machine.

Scope: the choice of the serving dtype for :func:`~specfoundry.runtime.models.load_target`, by
measurement. Plain decoding is the speed a speculator has to beat, so the serving dtype is the
one with the fastest plain step here (issue 11): on a CPU with bf16 instructions (avx512_bf16,
AMX) bfloat16 streams half the bytes and wins, on one without them PyTorch emulates bf16 and
float32 wins. On CUDA no measurement is needed: bfloat16 where supported, else float16.

The measurement: the model in float32 and a bfloat16 copy, each behind the same backend, a
64-token prefill, then single-token decode steps timed alternately (best of ``reps`` each, so
a burst of load on a shared machine hits both). A few seconds at the first load on a machine,
then kept (:mod:`.choices`: each later process serves in that dtype, so the same text); the line
it prints says what was measured and where it is kept. Where a float32 copy would not fit
comfortably in memory the choice is bfloat16 without measuring, and the line says so.
"""

from __future__ import annotations

import copy

import torch

from . import choices, native
from .timing import best_seconds


def plain_step_seconds(target, reps: int = 5, past: int = 64) -> float:
    """Best time of one plain decode step (one new token after ``past`` cached ones)."""
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache(capacity=past + 8)
    target.forward(torch.randint(0, target.vocab_size, (1, past), generator=gen), cache)
    cache.commit()
    ids = torch.randint(0, target.vocab_size, (1, 1), generator=gen)

    def once():
        target.forward(ids, cache, logits_for=torch.zeros(1, dtype=torch.long))
        cache.rollback()

    return best_seconds(once, reps, target.device)


def choose(model, wrap, device: torch.device, reps: int = 5, key: dict | None = None) -> tuple[torch.dtype, dict]:
    """(dtype, what was measured) for a float32 HF ``model`` on ``device``; ``wrap(model)`` builds
    the target the caller will serve (same backend for every candidate). On a CPU the choice is kept
    per machine (:func:`.choices.kept`, under ``key`` (the caller's backend) with the thread count and the
    model's parameter shapes): a later process serves in the same dtype without measuring (a dtype
    is the target's whole arithmetic: measured afresh, two processes could serve different text)."""
    if device.type == "cuda":
        dt = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return dt, {"reason": "CUDA: bfloat16 where supported, else float16"}
    if device.type != "cpu":
        return torch.float32, {"reason": f"{device.type}: float32 (not measured)"}
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    avail = native.available_memory()
    if avail is not None and 1.5 * nbytes > avail:
        return torch.bfloat16, {"reason": f"a float32 copy ({nbytes / 2**30:.1f} GiB) would not fit next to the "
                                          f"bfloat16 one in {avail / 2**30:.1f} GiB available: bfloat16 unmeasured"}
    measured = {}

    def measure() -> dict:
        half = copy.deepcopy(model).to(torch.bfloat16)  # copied before wrapping re-points the model's weights
        targets = {torch.float32: wrap(model), torch.bfloat16: wrap(half)}
        best = {dt: float("inf") for dt in targets}
        for _ in range(reps):  # alternate, so a burst of outside load hits both candidates
            for dt, t in targets.items():
                best[dt] = min(best[dt], plain_step_seconds(t, reps=1))
        dt = min(best, key=best.get)
        measured["target"] = targets[dt]
        return {"dtype": _name(dt), "ms_per_token": {_name(k): round(1000 * v, 2) for k, v in best.items()}}

    parts = {**(key or {}), "threads": torch.get_num_threads(), "count": sum(1 for _ in model.parameters()),
             "parameters": sorted({tuple(p.shape) for p in model.parameters()})}

    def valid(v) -> bool:
        return isinstance(v, dict) and v.get("dtype") in _DTYPES and isinstance(v.get("ms_per_token"), dict)

    value, where = choices.kept("serving-dtype", parts, measure, valid)
    dt = _DTYPES[value["dtype"]]
    info = {"ms_per_token": value["ms_per_token"], "threads": torch.get_num_threads(), "from": where}
    if "target" in measured:
        info["target"] = measured["target"]
    return dt, info


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(name: str, dtype: torch.dtype, info: dict) -> str:
    """The one line :func:`~specfoundry.runtime.models.load_target` prints for ``dtype="auto"``."""
    chosen = str(dtype).removeprefix("torch.")
    ms = info.get("ms_per_token")
    if not ms:
        return f"[specfoundry] {name}: dtype auto -> {chosen} ({info.get('reason', '')})"
    measured = ", ".join(f"{k} {v} ms" for k, v in ms.items())
    return (f"[specfoundry] {name}: dtype auto -> {chosen} (plain decode step measured: {measured}; {info['threads']} "
            f"thread(s); {info.get('from', 'measured')})")
