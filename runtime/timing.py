"""Timing a piece of work for the runtime's measured choices (kernels, dtypes, product paths): the best
wall time of a few calls. Its own module so that the kernels' modules can time themselves without
importing the engine."""

from __future__ import annotations

import time

import torch


def best_seconds(fn, reps: int, device: torch.device | None = None, warm: bool = True) -> float:
    """Best wall time of ``reps`` calls of ``fn`` (after one untimed call when ``warm``); CUDA is
    synchronised around each call so the work, not the launch, is timed."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    if warm:
        fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best
