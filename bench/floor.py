"""The weight-streaming floor: how fast plain decoding could be on this machine at best.

Scope: two measurements the bench report prints beside its speed-ups (issue 11): the machine's
read bandwidth at the bench's thread count, and the bytes of weights one decode step must read.
A batch-1 decode step of a small model is memory-bound: every matrix is read once per token, so
``weight bytes / read bandwidth`` is a lower bound on its time per token, and plain decoding's
distance from it says how much is left to gain without speculation.
"""

from __future__ import annotations

import time

import torch

from specfoundry.runtime import hugepages


def read_bandwidth_gbs(megabytes: int = 256, reps: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 bytes) at the current torch thread count: the best of ``reps``
    reductions over a ``megabytes`` float32 buffer (about a small target's weights: on most machines met far larger
    than the caches; a Xeon with 260 MB of L3 may serve part of it, and of the weights, from there). The bench reads it
    before and after its run and takes the higher: one reading moves with the machine's load."""
    if megabytes < 1 or reps < 1:
        raise ValueError("megabytes and reps must be >= 1")
    n = megabytes * 2**20 // 4
    # on the pages the engine streams its weights from: 2 MB ones where it uses them (runtime/hugepages.py;
    # a Zen 4 EPYC read 32.8 GB/s from them at 1 thread against 28.2 from 4 KB pages: the floor would sit
    # above what the engine can reach)
    buf = hugepages.Arena([(n,)], torch.float32).take((n,)) if hugepages.wanted() \
        else torch.empty(n, dtype=torch.float32)
    buf.fill_(1.0)  # first touch: page faults are not bandwidth
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode step reads: every parameter once (tied tensors once),
    less an input embedding table that is not also the LM head (a step reads one row of it)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and (head is None or head.weight.data_ptr() != emb.data_ptr()):
        total -= emb.numel() * emb.element_size()
    return total


def weight_streaming_floor(model: torch.nn.Module, bandwidth_gbs: float | None = None) -> dict:
    """``{"read_gbs", "weight_bytes", "floor_ms", "threads"}`` for ``model`` on this machine."""
    gbs = bandwidth_gbs if bandwidth_gbs is not None else read_bandwidth_gbs()
    nbytes = streamed_weight_bytes(model)
    return {"read_gbs": gbs, "weight_bytes": nbytes, "floor_ms": 1000 * nbytes / (gbs * 1e9),
            "threads": torch.get_num_threads()}
