"""Resolve MKL's vector-math (VML) kernels once, in one thread, before any parallel use.

PyTorch's x86 wheels route contiguous float32/float64 unary ops (``cos``, ``sin``, ``exp``, ``log``,
``sqrt``, ``tanh``, ``erf`` ...) to MKL VML, called by each OpenMP worker on its chunk. oneMKL 2024.2
(the wheels' pin) picks each function's kernel lazily on its first call, and when that first call
runs on several threads at once one thread can run a low-accuracy kernel for its whole chunk
(pytorch/pytorch#188792). Here that was the engine's RoPE cos table: in 2 of 60 fresh 2-thread
processes half the positions' cos were up to 1.5e-4 off (a one-step bf16 difference in ~1.7% of
entries), so the same prompt could decode to other text in another process (forty-eighth session,
``docs/results.md``). A call on a few elements runs in the calling thread and resolves the dispatch
there (0 odd tables in 97 processes after an 8-element cos), and :func:`warm` then runs a chunk on
every pool thread too (with the calling-thread call alone, 1 process in 70 still had one). Cost: a
few milliseconds, once per process.

The engine's RoPE tables are also computed until two computations agree (``engine.RopeTable``):
a worker thread that the pool starts later (a larger ``torch.set_num_threads``) makes its own first
call, which no warm-up at import reaches.
"""

from __future__ import annotations

import torch

# the functions ATen's vml.h sends to MKL (acos ... trunc); a name this torch lacks is skipped
VML_FUNCTIONS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10", "log1p",
                 "log2", "sin", "sqrt", "tan", "tanh", "trunc", "abs")

_done = False


def warm() -> None:
    """Call every VML-backed op on a few elements (the calling thread alone: far under ATen's grain of
    2048, which resolves the dispatch without a race), then on one chunk per intra-op thread, so
    that each worker's first call is a discarded one too (a fresh 2-thread process that had warmed
    in the calling thread only still gave one odd table in 70). Idempotent; a torch built without
    MKL just runs cheap ops."""
    global _done
    if _done:
        return
    with torch.inference_mode():
        for size in (8, 4096 * max(torch.get_num_threads(), 1)):
            for dtype in (torch.float32, torch.float64):
                x = torch.full((size,), 0.5, dtype=dtype)  # inside every function's domain
                for name in VML_FUNCTIONS:
                    fn = getattr(torch, name, None)
                    if fn is not None:
                        fn(x)
    _done = True
