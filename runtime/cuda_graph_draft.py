"""An EAGLE head's greedy drafting with fully static shapes, captured in CUDA graphs.

Scope: one :class:`~specfoundry.runtime.drafters.eagle.EagleDrafter`'s greedy proposals on CUDA:
running the queued committed pairs (bucketed like :mod:`.cuda_graph`'s target steps) and drafting
a chain or an EAGLE-2 tree from the new root, on the drafter's own head cache. Sampled drafts, the
prompt's pairs (more than the largest bucket) and non-CUDA heads keep the drafter's eager path.

Why: on an H200 the target's steps run graphed in 2.3-3.0 ms, while the head's eager drafting
(one decoder layer per depth plus the tree search's small ops, dozens of kernel launches and
several host syncs per depth) cost more than the target's whole step, so speculation with a
trained head ran at 0.19x plain (docs/results.md, twenty-fifth session).

How the shapes stay static: the head's K/V are written with ``index_copy_`` at positions computed
on the device from ``length`` (0-dim tensor: the committed entries before the queue) and ``count``
(the queue's real rows); attention runs over the cache's whole capacity with a bool mask built on
the device. The tree search is the drafter's own (:meth:`EagleDrafter.greedy_search`, every size
fixed by (depth, top_k, budget)) with this module's step and a top-k by stable descending sort
(equal scores in index order, what :func:`~.drafters.eagle.topk_first` guarantees, without its
host read), so on a CPU, where the same functions run eagerly (``capture=False``), the drafts equal
the eager search's (tested). The graphs' outputs are
read once per proposal (one host sync) to build the :class:`~specfoundry.runtime.tree.Draft`.
"""

from __future__ import annotations

import torch

from .cuda_graph import bucket_for
from .kvcache import StaticKVCache, grouped_attention
from .tree import Draft, subtree

__all__ = ["QUEUE_BUCKETS", "GraphedEagleDraft", "stable_topk"]

# queued pairs per proposal: the accepted drafts plus the bonus token (a few), up to a long chain's
QUEUE_BUCKETS = (1, 2, 4, 8, 16, 32)


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``x`` along the last dim (values, indices; largest first, equal values
    in index order) without a host sync: :func:`~.drafters.eagle.topk_first`'s result."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
    return x.gather(-1, order), order


class GraphedEagleDraft:
    """Static-shape greedy drafting of ``drafter`` (see the module doc) on its head cache ``cache``;
    ``capture`` None = on CUDA. A cache regrown or replaced (a longer request) is picked up by
    :meth:`ensure`, which rebuilds the buffers and drops the graphs."""

    def __init__(self, drafter, cache: StaticKVCache, capture: bool | None = None,
                 queue_buckets: tuple[int, ...] = QUEUE_BUCKETS):
        self.drafter, self.head = drafter, drafter.head
        self.queue_buckets = tuple(sorted(queue_buckets))
        self.capture = cache.kv.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and cache.kv.device.type != "cuda":
            raise ValueError("CUDA graph capture needs a CUDA cache")
        self.captures = 0  # graphs captured (for tests and measurements)
        self.runs = 0  # static functions run or replayed
        self.cache = cache
        self._reset()

    # -- buffers and graphs ---------------------------------------------------------------
    @torch.inference_mode()
    def _reset(self) -> None:
        head, cache = self.head, self.cache
        self.kv = cache.kv
        dev, cap = self.kv.device, cache.capacity
        a = head.architecture
        pos = torch.arange(cap, device=dev).view(1, -1)
        like = torch.zeros(1, 1, 1, device=dev, dtype=head.dtype)
        with torch.inference_mode(False), torch.no_grad():
            cos, sin = head.rotary_emb(like, pos)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, D]: every position the cache can hold
        self.cols = torch.arange(cap, device=dev)
        self.length = torch.zeros((), dtype=torch.long, device=dev)  # committed entries before the queue
        self.count = torch.ones((), dtype=torch.long, device=dev)  # the queue's real rows
        self.root = torch.zeros(1, a["hidden_size"], dtype=head.dtype, device=dev)  # the root's head output
        self.groups = a["num_attention_heads"] // a["num_key_value_heads"]
        self.queue_inputs: dict[int, tuple] = {}
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None

    def ensure(self, cache: StaticKVCache, need: int) -> None:
        """Make room for ``need`` more entries past the committed ones in ``cache`` (regrowing it
        drops the graphs), and follow a replaced cache."""
        if cache is not self.cache or cache.kv is not self.kv:
            self.cache = cache
            self._reset()
        if cache.length + need > cache.capacity:
            cache.reserve(need)  # doubles the capacity: new storage, new graphs
            self._reset()

    def _mask(self, base: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Bool ``[1, 1, g*m, capacity]``: columns before ``base`` (a 0-dim device tensor) visible,
        ``block`` ``[m, S]`` over the columns ``base .. base+S-1``, every later column hidden."""
        m, S = block.shape
        rel = self.cols - base
        inside = (rel >= 0) & (rel < S)
        mask = (rel < 0) | (inside & block[:, rel.clamp(0, S - 1)])  # [m, capacity]
        return mask.repeat(self.groups, 1).view(1, 1, self.groups * m, -1)

    def _layer(self, ids: torch.Tensor, hidden: torch.Tensor, base: torch.Tensor, offset: int,
               block: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The head's decoder layer for ``m`` rows (``ids`` ``[1, m]``, ``hidden`` ``[1, m, H]``)
        written at ``base + offset + arange(m)``, attending as ``block`` ``[m, offset+m]`` says over
        the entries from ``base`` on (everything before ``base`` visible)."""
        head = self.head
        kv = self.kv[0]  # the head's one layer: [2, 1, hkv, capacity, D]
        m = ids.shape[1]
        write = base + offset + torch.arange(m, device=ids.device)
        mask = self._mask(base, block)

        def attention(q, k, v):
            kv[0].index_copy_(2, write, k.transpose(1, 2))
            kv[1].index_copy_(2, write, v.transpose(1, 2))
            return grouped_attention(q, kv[0], kv[1], mask, head.layer.self_attn.scaling)

        def rope(p):
            return self.cos[p].unsqueeze(2), self.sin[p].unsqueeze(2)

        return head._layer_step(ids, hidden, positions, attention, rope)

    def static_queue(self, n: int) -> None:
        """Bucket ``n`` of the queued pairs: the head over them (causal), K/V written from
        ``length`` on; the output of row ``count - 1`` becomes the root."""
        ids, features = self.queue_inputs[n]
        head = self.head
        hidden = head.fuse_features(features)
        positions = (self.length + torch.arange(n, device=ids.device)).view(1, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        out = self._layer(ids, hidden, self.length, 0, causal, positions)  # [1, n, H]
        self.root.copy_(out[0].index_select(0, self.count - 1))

    def static_chain(self, depth: int) -> torch.Tensor:
        """A greedy chain of ``depth`` drafts (target ids ``[depth]``) from the root:
        :meth:`EagleDrafter._grow_chain`'s argmax per depth."""
        head = self.head
        d2t = head.draft_to_target
        base = self.length + self.count  # the first draft entry
        h = self.root.view(1, 1, -1)
        drafts = []
        for d in range(depth):
            tok = head.compute_logits(h[:, -1]).argmax(-1)  # [1]
            tok = tok if d2t is None else d2t[tok]
            drafts.append(tok)
            if d + 1 < depth:
                seen = torch.ones(1, d + 1, dtype=torch.bool, device=tok.device)  # every earlier draft
                h = self._layer(tok.view(1, 1), h, base, d, seen, (base + d).view(1, 1))
        return torch.cat(drafts)

    def static_tree(self, depth: int, top_k: int, budget: int) -> tuple[torch.Tensor, ...]:
        """EAGLE-2's greedy tree: the drafter's own search (:meth:`EagleDrafter.greedy_search`, same
        ranking and ties) with this module's static step and sync-free top-k: the candidates' target
        ids and parents (1-based, 0 = root) ``[M]`` and the kept candidates ``[budget]`` (sorted)."""
        base = self.length + self.count

        def step(ids, hidden, parent_rows, d):
            s = ids.shape[0]
            rows = torch.cat([parent_rows, torch.eye(s, dtype=torch.bool, device=ids.device)], dim=1)
            out = self._layer(ids.view(1, s), hidden.view(1, s, -1), base, parent_rows.shape[1], rows,
                              (base + d).expand(1, s))
            return out[0], rows

        return self.drafter.greedy_search(self.root, depth, top_k, budget, step, stable_topk)

    def _run(self, key: tuple, fn):
        """``fn()`` eagerly, or replayed from the graph captured for ``key`` (captured on first use)."""
        self.runs += 1
        if not self.capture:
            return fn()
        if key not in self.graphs:
            dev = self.kv.device
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up; its writes land past the committed entries
                    fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn()
            self.pool = graph.pool() if self.pool is None else self.pool
            self.captures += 1
            self.graphs[key] = (graph, out)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    # -- one proposal ---------------------------------------------------------------------
    @torch.inference_mode()
    def run_queue(self, ids: torch.Tensor, features: torch.Tensor) -> None:
        """Run ``m`` queued pairs (``ids`` ``[1, m]``, raw target ``features`` ``[1, m, F, H]``,
        ``m`` at most the largest bucket) and commit them; the root becomes the last one's output."""
        cache = self.cache
        m = ids.shape[1]
        n = bucket_for(m, self.queue_buckets)
        if n not in self.queue_inputs:
            dev = self.kv.device
            self.queue_inputs[n] = (torch.zeros(1, n, dtype=torch.long, device=dev),
                                    torch.zeros(1, n, *features.shape[2:], dtype=features.dtype, device=dev))
        qi, qf = self.queue_inputs[n]
        if qf.shape[2:] != features.shape[2:] or qf.dtype != features.dtype:
            raise ValueError(f"features {tuple(features.shape)} {features.dtype} do not match the captured "
                             f"{tuple(qf.shape)} {qf.dtype}")
        self.length.fill_(cache.length)
        self.count.fill_(m)
        qi[:, :m].copy_(ids, non_blocking=True)
        qf[:, :m].copy_(features, non_blocking=True)
        if m < n:  # padded rows: finite inputs, their entries land past the committed ones
            qi[:, m:] = 0
            qf[:, m:] = 0
        self._run(("queue", n), lambda: self.static_queue(n))
        cache.mark_appended(m)
        cache.commit()

    @torch.inference_mode()
    def set_root(self, hidden: torch.Tensor) -> None:
        """The root's head output ``[1, H]`` computed elsewhere (the prompt's pairs, run eagerly)."""
        self.root.copy_(hidden.view(1, -1))
        self.length.fill_(self.cache.length)
        self.count.fill_(0)

    @torch.inference_mode()
    def propose(self, root: torch.Tensor, depth: int, top_k: int, budget: int) -> Draft:
        """A greedy chain (``top_k`` 1 and ``budget == depth``) or tree of ``depth`` and ``budget``
        drafts from the root (after :meth:`run_queue` or :meth:`set_root`)."""
        # length/count as run_queue or set_root left them: the drafts go right after the queue
        if top_k == 1 and budget == depth:
            drafts = self._run(("chain", depth), lambda: self.static_chain(depth))
            return Draft.chain(root.view(1).to(drafts.device), drafts.clone().view(1, depth), None)
        tok, par, keep = self._run(("tree", depth, top_k, budget), lambda: self.static_tree(depth, top_k, budget))
        return subtree(root, tok, par, keep, None)
