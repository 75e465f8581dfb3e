"""One engine step with fully static shapes, captured in CUDA graphs per bucket of node count.

Scope: the decode/verify step of one :class:`~specfoundry.runtime.engine.EngineTarget` against
one :class:`~specfoundry.runtime.kvcache.StaticKVCache` of fixed capacity, its static buffers and
its graphs; nothing about prefill (variable length: the ordinary forward), drafting or sampling.

The engine's ordinary forward attends over ``cache[: past+n]``, a shape that changes every step.
:class:`GraphedStep` instead runs, per bucket ``n`` in :data:`BUCKETS`, a function whose shapes
never change: the new K/V are written with ``index_copy_`` at ``length + arange(n)`` (``length``
a 0-dim device tensor: no host sync), attention runs over the whole capacity with a bool mask
built on the device (columns ``< length`` visible, the tree block over ``length .. length+n``,
everything later invisible) and logits come back for all ``n`` rows. A request of ``m`` nodes
is padded to the next bucket: padded rows see the prefix and themselves, their outputs are
dropped and their K/V land past the accepted entries, to be overwritten later.

On CUDA each bucket is warmed up on a side stream and captured lazily (one memory pool shared by
all buckets); a step copies its inputs into the bucket's static buffers and replays. On a CPU
(or ``capture=False``) the very same function runs eagerly, so CPU tests check exactly what
would be captured. The caller commits with ``cache.commit(keep)`` as after any forward; the
committed length stays on the host side of the cache and is copied to the device tensor at
each step. :class:`GraphedTarget` puts the step behind the target interface for
:class:`~specfoundry.runtime.generator.SpeculativeGenerator`.

On a CUDA machine ``python -m specfoundry.runtime.cuda_graph`` prints eager vs graphed ms per step.
"""

from __future__ import annotations

import torch

from .engine import EngineTarget, StaticKVCache, grouped_attention
from .target import TargetOutput

__all__ = ["BUCKETS", "GraphedStep", "GraphedTarget", "bucket_for", "measure"]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """The smallest bucket holding ``n`` nodes; a ValueError past the largest."""
    if n < 1:
        raise ValueError(f"a step needs at least one node, got {n}")
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} nodes exceed the largest graph bucket ({buckets[-1]}); use the ordinary forward")


class GraphedStep:
    """Static-shape steps of ``target`` on ``cache`` (see the module doc). ``feature_layers`` are
    fixed per instance (they are part of the captured outputs); ``capture`` None = on CUDA."""

    def __init__(self, target: EngineTarget, cache: StaticKVCache, feature_layers: tuple[int, ...] = (),
                 buckets: tuple[int, ...] = BUCKETS, capture: bool | None = None):
        self.target, self.cache = target, cache
        self.feature_layers = tuple(feature_layers)
        self.buckets = tuple(sorted(buckets))
        self.capture = cache.kv.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and cache.kv.device.type != "cuda":
            raise ValueError("CUDA graph capture needs a CUDA cache")
        self.captures = 0  # graphs captured (for tests and measurements)
        self._reset()

    @torch.inference_mode()
    def _reset(self) -> None:
        """(Re)build everything tied to the engine's weights and the cache's storage."""
        self.engine = self.target._engine()
        self.kv = self.cache.kv
        e, B, dev = self.engine, self.cache.batch, self.kv.device
        pos = torch.arange(self.cache.capacity, device=dev).view(1, -1)  # positions < capacity
        cos, sin = e.rotary(e.embed[:1].view(1, 1, -1), pos)
        self.cos, self.sin = cos[0], sin[0]  # own tables: the engine may regrow its own
        self.length = torch.zeros((), dtype=torch.long, device=dev)
        self.cols = torch.arange(self.cache.capacity, device=dev)
        self.inputs: dict[int, tuple] = {}
        for n in self.buckets:
            self.inputs[n] = (torch.zeros(B, n, dtype=torch.long, device=dev),  # tokens
                              torch.zeros(B, n, dtype=torch.long, device=dev),  # positions
                              torch.eye(n, dtype=torch.bool, device=dev).repeat(B, 1, 1))  # tree block
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def mask(self, block: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, 1, g*n, capacity]`` from the device length and ``block`` ``[B, n, n]``."""
        B, n = block.shape[0], block.shape[1]
        rel = self.cols - self.length  # column index relative to the first new entry
        inside = (rel >= 0) & (rel < n)
        m = (rel < 0) | (inside & block[:, :, rel.clamp(0, n - 1)])  # [B, n, capacity]
        return m.repeat(1, self.engine.groups, 1).unsqueeze(1)

    def static_step(self, n: int) -> TargetOutput:
        """The function captured for bucket ``n``: reads only the static buffers, writes the cache
        at ``length .. length+n`` and returns logits ``[B, n, V]`` (and the feature layers)."""
        e, kv = self.engine, self.kv
        tokens, positions, block = self.inputs[n]
        mask = self.mask(block)
        write = self.length + torch.arange(n, device=tokens.device)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)

        def attention(i, q, k, v):
            layer = kv[i]  # [2, B, hkv, capacity, D]
            layer[0].index_copy_(2, write, k.transpose(1, 2))
            layer[1].index_copy_(2, write, v.transpose(1, 2))
            return grouped_attention(q, layer[0], layer[1], mask, e.scale)

        x, feats = e.run_layers(tokens, cos, sin, attention, self.feature_layers)
        return e.finish(x, feats, self.feature_layers, None)

    def _graph(self, n: int) -> tuple:
        """Warm bucket ``n`` up on a side stream, then capture it (into the shared pool)."""
        side = torch.cuda.Stream(device=self.kv.device)
        side.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # writes land past the committed length: harmless
                self.static_step(n)
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.static_step(n)
        self.pool = graph.pool() if self.pool is None else self.pool
        self.captures += 1
        return graph, out

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
             tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """Like ``target.forward(input_ids, cache, position_ids, tree_mask, feature_layers)``:
        ``m`` new tokens ``[B, m]`` (``tree_mask`` ``[m, m]`` or ``[B, m, m]``, None = causal), run
        in the bucket of ``m``; positions must be below the capacity (RoPE tables of that length);
        commit or roll back the cache afterwards. On CUDA the returned
        tensors are views of the graph's outputs, overwritten by the next step of that bucket."""
        cache = self.cache
        cache.check_ready()
        B, m = input_ids.shape
        n = bucket_for(m, self.buckets)
        if B != cache.batch:
            raise ValueError(f"input batch {B} != cache batch {cache.batch}")
        if cache.length + n > cache.capacity:
            raise ValueError(f"{cache.length} cached + {n} (bucket of {m}) exceed the capacity {cache.capacity}")
        if cache.kv is not self.kv or self.target._engine() is not self.engine:
            self._reset()  # the cache was regrown or the weights changed: stale tables and graphs
        past = cache.length
        tokens, positions, block = self.inputs[n]
        dev = tokens.device
        self.length.fill_(past)
        tokens[:, :m].copy_(input_ids, non_blocking=True)
        if position_ids is None:
            positions[:, :m].copy_(torch.arange(past, past + m, device=dev))
        else:
            positions[:, :m].copy_(position_ids, non_blocking=True)
        if m < n:
            tokens[:, m:] = 0
            positions[:, m:] = past  # any valid position: the padded rows' outputs are dropped
        block.copy_(torch.eye(n, dtype=torch.bool, device=dev))
        if tree_mask is None:
            block[:, :m, :m] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        else:
            block[:, :m, :m] = tree_mask.to(dev, torch.bool)
        if not self.capture:
            out = self.static_step(n)
        else:
            if n not in self.graphs:
                self.graphs[n] = self._graph(n)
            graph, out = self.graphs[n]
            graph.replay()
        cache.mark_appended(m)
        features = None if out.features is None else out.features[:, :m]
        return TargetOutput(logits=out.logits[:, :m], features=features)


class GraphedTarget:
    """``target`` with steps of at most ``max(buckets)`` nodes (no ``logits_for``) run by a
    :class:`GraphedStep`; everything else is the target's own. It keeps one cache and reuses it
    across requests (a request at a time, as the generator guarantees), so graphs are captured
    once per bucket, not per request; a larger request regrows it (and recaptures)."""

    def __init__(self, target: EngineTarget, buckets: tuple[int, ...] = BUCKETS, capture: bool | None = None):
        self.target, self.buckets, self.capture = target, buckets, capture
        self.steps: dict[tuple, GraphedStep] = {}
        self._cache: StaticKVCache | None = None

    def __getattr__(self, name):
        if name == "target":
            raise AttributeError(name)
        return getattr(self.target, name)

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> StaticKVCache:
        need = capacity or 1024
        c = self._cache
        if c is None or c.batch != batch or c.capacity < need:
            c = self._cache = self.target.new_cache(batch, need)
            self.steps.clear()
        c.crop(0)
        return c

    def forward(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                logits_for: torch.Tensor | None = None) -> TargetOutput:
        n = input_ids.shape[1]
        if cache is not self._cache or logits_for is not None or n > max(self.buckets) \
                or cache.length + bucket_for(n, self.buckets) > cache.capacity:
            return self.target.forward(input_ids, cache, position_ids, tree_mask, feature_layers, logits_for)
        key = tuple(feature_layers)
        if key not in self.steps:
            self.steps[key] = GraphedStep(self.target, cache, key, self.buckets, self.capture)
        return self.steps[key].step(input_ids, position_ids, tree_mask)


@torch.inference_mode()
def measure(target_name: str = "smollm2-135m", past: int = 256, reps: int = 20, dtype: str = "bfloat16") -> dict:
    """Best ms per step after ``past`` tokens, per bucket: the engine's ordinary forward vs the
    captured graph, and the largest logit difference between them (CUDA only; returns ``{}``
    and says so where CUDA is absent)."""
    from .timing import best_seconds
    from .models import load_target

    if not torch.cuda.is_available():
        print("cuda_graph measure: skipped (torch.cuda is not available)")
        return {}
    target = load_target(target_name, device="cuda", dtype=getattr(torch, dtype), backend="engine")
    cache = target.new_cache(capacity=past + max(BUCKETS))
    gen = torch.Generator().manual_seed(0)
    target.forward(torch.randint(0, target.vocab_size, (1, past), generator=gen), cache)
    cache.commit()
    graphed = GraphedStep(target, cache)
    rows = {}
    print(f"{target_name} {dtype} past={past}: ms per step (best of {reps})\n    n   eager  graphed  speedup")
    for n in BUCKETS:
        ids = torch.randint(0, target.vocab_size, (1, n), generator=gen).cuda()

        def eager():
            target.forward(ids, cache)
            cache.rollback()

        def replay():
            graphed.step(ids)
            cache.rollback()

        e_ms = 1e3 * best_seconds(eager, reps, cache.kv.device)
        g_ms = 1e3 * best_seconds(replay, reps, cache.kv.device)
        ref = target.forward(ids, cache).logits.float()
        cache.rollback()
        diff = float((graphed.step(ids).logits.float() - ref).abs().max())
        cache.rollback()
        rows[n] = {"eager_ms": e_ms, "graphed_ms": g_ms, "max_abs_logit_diff": diff}
        print(f"{n:5d} {e_ms:7.3f} {g_ms:8.3f} {e_ms / g_ms:7.2f}x  max|dlogit| {diff:.2e}")
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="eager vs CUDA-graphed engine steps per bucket (CUDA only)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--past", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    a = p.parse_args()
    measure(a.target, a.past, dtype=a.dtype)
