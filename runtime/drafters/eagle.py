"""EAGLE drafters (``"eagle"``: EAGLE-1 head, ``"eagle3"``: EAGLE-3 head): draft trees from a head.

Scope: the head's KV bookkeeping and the tree search (EAGLE-2 dynamic trees, or chains) for one
sequence (batch size 1). The head modules are in ``runtime/speculators/eagle.py``.

KV cache. The head keeps its own preallocated :class:`~specfoundry.runtime.kvcache.StaticKVCache`
over committed pairs ``(feature of token t, token t+1)``, run by the head's in-place
:meth:`~specfoundry.runtime.speculators.eagle._EagleBase.step`. Committed pairs are queued by ``begin``/``commit`` and
run at the next ``propose`` (so nothing is computed for a sequence that ends). The tree search
then appends draft entries (positions by depth, an ancestor mask) and crops the cache back to
the committed length before returning. Where the head has ``fused_draft`` (EAGLE-3 on the AVX-512
BF16 kernels, at most ``cpu_layers.MAX_TOKENS`` queued pairs) the queue runs in one C call, with the
proposal in the same call: a chain (greedy, or sampled with a plain temperature) or a greedy tree
(top-k up to ``MAX_C_TOP_K``): the same drafts as the step-by-step search below, without ~0.5 ms of
Python per step (a longer queue, a prompt's pairs, runs step by step and the proposal then takes the C
call alone). Trees rank by the C log-probabilities where the head's logits are bf16, with equal
scores in index order (:func:`topk_first`), so both searches keep the same nodes.

Chains (a node budget equal to the depth): the argmax (greedy) or one draw from ``q`` (sampling)
at every depth, no tree search.
Greedy mode (EAGLE-2): the root gets ``top_k`` children; at each further depth the ``top_k``
newest nodes with the best cumulative log-probability are expanded (one head forward for all of
them), each with ``top_k`` children; finally the best ``max_nodes - 1`` nodes by cumulative
score are kept. Scores never increase along a path, so with index tie-breaks the kept set is
closed under ancestors.

Sampling mode: every child is drawn (with ``ctx.generator``) from the processed draft
distribution ``q = probs_from_logits(logits, ctx.sampling)`` over the target vocabulary, siblings
without replacement; ``Draft.q`` records the distribution each node was drawn from. How many
children a node gets is fixed before any of them is drawn, from values already drawn: per depth
a share of the remaining node budget goes to the slots ``(node, j)`` with the largest
``P(node) * (j-th largest q of node)``. Nothing drawn is dropped afterwards (a rerank on the
drafts' own values would bias the output).

Options: ``tree`` ("dynamic" | "chain"; chain = ``top_k`` 1), ``depth`` (5), ``top_k`` (8),
``total_tokens`` (32 nodes including the root). ``ctx.max_depth``/``ctx.max_nodes`` lower them.
``draft_temperature`` (1.0, or the checkpoint's measured ``training.draft_temperature``): sampling
requests draw drafts at this multiple of their temperature (``sampling.draft_params``; lossless at any
value, since ``Draft.q`` records what was drawn from: it only moves the acceptance, see
``runtime/calibrate.py``). ``sampled_trees`` (False): sampling requests draft a chain of the tree's depth, as the serving
engine's rows do; True drafts the sampled tree above. Why: a sampled tree is drafted and verified
step by step in Python where a chain runs in C, and at T=1 a tree barely accepts more: the default
head on Spec-Bench, 2 threads, lookup-tree@2/4 0.91x plain (draft 3.1 ms, verify 11.3 ms per step,
tau 1.36) against lookup@2 1.09x (1.5 ms, 9.5 ms, tau 1.32) (docs/results.md, twenty-fifth session).
``prompt_window`` (:data:`PROMPT_WINDOW`; 0 = all): the head runs only the prompt's last that many
pairs (:func:`prompt_pairs`), its positions counted from the first of them (RoPE scores depend
only on distances); the drafts change, never the output. Why: on a long prompt the head's pass
over every pair and its attention over them afterwards cost more than its drafting: Spec-Bench's
rag / summarization first turns (~700 tokens), 1 thread, ~80 ms for the pass and 2.0 ms per
proposal after it against 1.4 ms on short prompts, while its tau was the same with the last 16-256
pairs (docs/results.md, forty-sixth session).
"""

from __future__ import annotations

import math
import os

import torch

from .. import cpu_layers
from ..adaptive import MAX_DRAFT_DEPTH, MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, check_int, check_real
from ..cuda_graph import bucket_for
from ..sampling import draft_params, probs_from_logits, sample, tree_log_probs
from ..speculators import Eagle3Head, EagleHead, load_speculator, read_config
from ..speculators.checkpoint import DRAFT_SHAPE_KEYS, MAX_DRAFT_TEMPERATURE, default_draft_shape
from ..target import KVCache
from ..tree import Draft, over_target_vocab, subtree
from .base import DraftContext, Drafter, register_drafter

__all__ = ["EagleDrafter", "Eagle3Drafter", "PROMPT_WINDOW", "prompt_pairs"]

MAX_C_TOP_K = cpu_layers.MAX_TOKENS  # a greedy tree's top-k the head's one C call takes (its steps' rows)
#: prompt pairs the head runs by default (the default head trains on 320-token sequences; see the module doc)
PROMPT_WINDOW = 64


def prompt_pairs(prompt_ids: torch.Tensor, features: torch.Tensor | None,
                 window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The committed pairs of a prompt ``[1, L]`` (next ids ``prompt_ids[:, 1:]``, ``features``
    ``[1, L-1, F, H]`` or None) a head runs: the last ``window`` of them (all for 0)."""
    next_ids = prompt_ids[:, 1:]
    if window and next_ids.shape[1] > window:
        next_ids = next_ids[:, -window:]
        features = None if features is None else features[:, -window:]
    return next_ids, features


class EagleDrafter(Drafter):
    type = "eagle"
    head_class = EagleHead

    def __init__(self, head, *, tree: str = "dynamic", depth: int = 5, top_k: int = 8, total_tokens: int = 32,
                 sampled_trees: bool = False, draft_temperature: float = 1.0, prompt_window: int = PROMPT_WINDOW):
        if not isinstance(head, self.head_class):
            raise TypeError(f"the {self.type} drafter needs a {self.head_class.__name__}, got {type(head).__name__}")
        if tree not in ("dynamic", "chain"):
            raise ValueError(f"tree must be 'dynamic' or 'chain', got {tree!r}")
        depth = check_int("depth", depth, 1, MAX_DRAFT_DEPTH)
        top_k = check_int("top_k", top_k, 1, MAX_DRAFT_TOP_K)
        total_tokens = check_int("total_tokens", total_tokens, 2, MAX_DRAFT_NODES)
        if not isinstance(sampled_trees, bool):
            raise ValueError(f"sampled_trees must be True or False, got {sampled_trees!r}")
        self.draft_temperature = check_real("draft_temperature", draft_temperature, 0.0, MAX_DRAFT_TEMPERATURE,
                                            lo_open=True)
        self.prompt_window = check_int("prompt_window", prompt_window, 0)
        self.head = head.eval()
        self.tree = tree
        self.sampled_trees = sampled_trees
        self.depth = depth
        self.top_k = 1 if tree == "chain" else min(top_k, head.draft_vocab_size)
        self.total_tokens = depth + 1 if tree == "chain" else total_tokens
        self.feature_layers = tuple(head.feature_layers)
        self.default_depth = depth
        self.default_nodes = self.total_tokens
        self.cache = None  # made by begin()
        # heads with an in-place step (ours) draft on a StaticKVCache; wrappers that only have the
        # HF-style forward (the ONNX Runtime head) keep a KVCache and full masks
        self._static = hasattr(head, "step") and hasattr(head, "new_cache")
        self._num_tokens = 0  # committed tokens, root included
        self._queue_ids: list[torch.Tensor] = []  # next tokens of pairs not yet run
        self._queue_features: list[torch.Tensor] = []  # the target's features of those pairs
        self._root_hidden: torch.Tensor | None = None  # head output for the root's pair [1, H]
        self._plan = False  # Eagle3Head.draft_plan for this request (None: none), False until taken
        self._graphs: bool | None = None  # use_cuda_graphs: None off, else the capture flag
        self._graphed = None  # its GraphedEagleDraft, made by begin()

    def use_cuda_graphs(self, on: bool, capture: bool | None = None) -> None:
        """Greedy proposals through :class:`~specfoundry.runtime.cuda_graph_draft.GraphedEagleDraft`
        (heads with an in-place step; captured where the head is on CUDA, or with ``capture``
        False the same static functions run eagerly, which CPU tests use). Off: the eager path."""
        on = bool(on) and self._static and (capture is False or self.head.device.type == "cuda")
        self._graphs = (capture if capture is not None else True) if on else None
        if not on:
            self._graphed = None

    def fork(self) -> "EagleDrafter":
        twin = super().fork()
        # its own cache, never this one's; and eager drafting: a fork serves one request, and graphs
        # captured per request would cost more than they save (use_cuda_graphs turns them on again)
        twin.cache, twin._graphed, twin._graphs = None, None, None
        return twin

    # -- protocol ------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        if prompt_ids.shape[0] != 1:
            raise ValueError(f"the {self.type} drafter serves one sequence (batch size 1)")
        need = 2 * prompt_ids.shape[1] + 256
        if self._graphs is not None and self.cache is not None and self.cache.capacity >= need:
            self.cache.crop(0)  # graphed: one cache across requests, so the graphs are captured once
        else:
            self.cache = self.head.new_cache(capacity=need) if self._static else KVCache()
        if self._graphs is not None:
            from ..cuda_graph_draft import GraphedEagleDraft

            if self._graphed is None:
                self._graphed = GraphedEagleDraft(self, self.cache, capture=self._graphs)
            self._graphed.ensure(self.cache, 0)
        self._queue_ids, self._queue_features = [], []
        self._root_hidden = None
        self._plan = False  # the head's draft_plan for this request, taken when first needed
        self._num_tokens = prompt_ids.shape[1]
        self._enqueue(*prompt_pairs(prompt_ids, features, self.prompt_window))

    def commit(self, new_tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        # features: old root + accepted drafts; pairs (feature_i, token_{i+1}) = (features, new_tokens)
        self._num_tokens += new_tokens.shape[1]
        self._enqueue(new_tokens, features)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        if self.cache is None:
            raise RuntimeError("call begin() before propose()")
        if ctx.tokens.shape[0] != 1 or ctx.tokens.shape[1] != self._num_tokens:
            raise RuntimeError(f"context has {tuple(ctx.tokens.shape)} tokens but the drafter committed "
                               f"{self._num_tokens}: begin/commit were not called for every step")
        budget = min(self.total_tokens, ctx.max_nodes) - 1
        # kept trees are ancestor-closed, so no kept node is deeper than the node budget
        depth = min(self.depth, ctx.max_depth, budget)
        sp = ctx.sampling
        if not sp.greedy and not self.sampled_trees and self._static:
            budget = depth  # a sampling request drafts a chain (see the module doc)
        chain = depth >= 1 and budget == depth and self._static
        # the C chain samples with a temperature only (no top-k / top-p processing of q)
        plain_q = sp.greedy or ((sp.top_k is None or sp.top_k >= self.head.draft_vocab_size)
                                and (sp.top_p is None or sp.top_p >= 1.0))
        if self._graphed is not None and sp.greedy and depth >= 1 and budget >= 1 \
                and (self._queue_ids or self._root_hidden is not None):
            return self._propose_graphed(ctx.tokens[:, -1], depth, 1 if chain else self.top_k,
                                         depth if chain else budget)
        # a greedy tree in the same call where its top-k fits the C step (budget >= 1 and depth >= 1)
        tree = not chain and sp.greedy and self._static and 1 <= depth and 1 <= budget and self.top_k <= MAX_C_TOP_K
        drafted = self._run_queue(depth if (chain and plain_q) or tree else 0, ctx, self.top_k if tree else 0,
                                  budget if tree else 0)
        if drafted is not None:  # drafted with the queued pairs, in one call: the Draft's rows, root first
            tokens, q, parents, host = drafted
            if q is not None:  # a sampled chain: q over the draft vocabulary, the root's (unused) row first
                return Draft(tokens, parents, q.unsqueeze(0), host=host, q_ids=self.head.draft_to_target)
            return Draft(tokens, parents, None, host=host)
        root = ctx.tokens[:, -1]  # (read here: the one-call drafting above needs only its id)
        if depth < 1 or budget < 1 or self._root_hidden is None:
            return Draft.root_only(root, ctx.root_id)
        base = self.cache.length
        try:
            if chain:
                return self._grow_chain(root, depth, ctx)
            if ctx.sampling.greedy:
                return self._grow_greedy(root, depth, budget)
            return self._grow_sampling(root, depth, budget, ctx)
        finally:
            self.cache.crop(base)  # drop every draft entry: the cache holds committed pairs only

    def _propose_graphed(self, root: torch.Tensor, depth: int, top_k: int, budget: int) -> Draft:
        """A greedy chain or tree from the static-shape drafting (see :meth:`use_cuda_graphs`): the
        queued pairs run in a bucket of at most ``QUEUE_BUCKETS[-1]`` rows (more, the prompt's:
        the eager step), then the draft."""
        g = self._graphed
        ids, features = _joined(self._queue_ids), _joined(self._queue_features)
        self._queue_ids, self._queue_features = [], []
        drafts = depth * top_k  # more than a chain or a tree of this shape writes
        m = 0 if ids is None else ids.shape[1]
        if 0 < m <= g.queue_buckets[-1]:
            g.ensure(self.cache, bucket_for(m, g.queue_buckets) + drafts)
            g.run_queue(ids, features)
        else:
            if m:  # the prompt's pairs: one eager step
                out = self.head.step(ids, self.head.fuse_features(features), self.cache)
                self.cache.commit()
                self._root_hidden = out[:, -1]
            g.ensure(self.cache, drafts)
            g.set_root(self._root_hidden)
        self._root_hidden = g.root
        return g.propose(root, depth, top_k, budget)

    # -- committed pairs -----------------------------------------------------------------
    def _enqueue(self, next_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        n = next_ids.shape[1]
        if features is None or n == 0:
            if n:
                raise ValueError(f"the {self.type} drafter needs target features (feature_layers={self.feature_layers})")
            return
        if features.shape[1] != n:
            raise ValueError(f"got features for {features.shape[1]} tokens, expected {n}")
        self._queue_features.append(features)  # fused with the rest of the queue when it runs
        # (no .to() when already there: a no-op tensor call still costs ~20 us right after a forward)
        self._queue_ids.append(next_ids if next_ids.device == self.head.device else next_ids.to(self.head.device))

    def _run_queue(self, chain: int = 0, ctx: DraftContext | None = None, top_k: int = 0,
                   budget: int = 0) -> tuple | None:
        """Run the queued pairs (the new root's head output becomes ``_root_hidden``). ``chain`` > 0:
        also draft a chain of that depth (greedy, or sampled with ``ctx``'s temperature), or with
        ``top_k`` > 0 a greedy tree of that depth and at most ``budget`` nodes, where the head does
        both in one call (``fused_draft``; a queue longer than that call takes runs step by step first, then
        the call drafts from its output): (the draft's ids ``[1, N]`` root first, the draft distributions
        or None, its parents ``[1, N]``); None otherwise (the caller drafts)."""
        ids, features = _joined(self._queue_ids), _joined(self._queue_features)
        if self._plan is False:  # the head's one-call drafting, checked once per request
            plan = getattr(self.head, "draft_plan", None) if self._static else None
            self._plan = None if plan is None else plan(self.cache)
        temperature = 0.0 if not chain or ctx.sampling.greedy else ctx.sampling.temperature * self.draft_temperature
        done = None if self._plan is None or (ids is None and not chain) else \
            self.head.fused_draft(ids, features, self._root_hidden, chain, self.cache, temperature,
                                  None if ctx is None else ctx.generator, top_k, budget,
                                  ctx.root() if chain else None, self._plan)
        self._queue_ids, self._queue_features = [], []
        if done is None and ids is not None:
            hidden = self.head.fuse_features(features)
            if self._static:
                out = self.head.step(ids, hidden, self.cache)  # causal over the committed pairs
            else:
                out = self.head(ids, hidden, cache=self.cache)
            self.cache.commit()
            self._root_hidden = out[:, -1]
            if chain and self._plan is not None:
                # a queue longer than the C call takes (a prompt's pairs) ran above: the draft itself still
                # takes the C call from its output (the Python tree search cost ~4 ms per request)
                done = self.head.fused_draft(None, None, self._root_hidden, chain, self.cache, temperature,
                                             ctx.generator, top_k, budget, ctx.root(), self._plan)
        if done is not None:
            drafts, self._root_hidden, q, parents, *host = done  # host lists: with a root id only
            return (drafts, q, parents, host[0] if host else None) if chain else None
        return None

    # -- tree search ---------------------------------------------------------------------
    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, parent_rows: torch.Tensor,
              position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``m`` draft nodes (target ids ``[m]``, parent outputs ``[m, H]``) at one depth.

        ``parent_rows`` ``[m, S]`` bool marks each node's ancestors among the ``S`` draft entries
        already in the cache. Returns head outputs ``[m, H]`` and the new ancestor rows
        ``[m, S + m]`` (ancestors plus the node itself)."""
        m = ids.shape[0]
        dev = hidden.device
        own = torch.eye(m, dtype=torch.bool, device=dev)
        rows = torch.cat([parent_rows, own], dim=1)  # over the draft entries only: no context-wide mask
        pos = torch.full((1, m), position, dtype=torch.long, device=dev)
        if self._static:
            out = self.head.step(ids.view(1, m), hidden.view(1, m, -1), self.cache, position_ids=pos,
                                 block=rows.unsqueeze(0))
        else:
            committed = self.cache.length - parent_rows.shape[1]
            allowed = torch.cat([torch.ones(m, committed, dtype=torch.bool, device=dev), rows], dim=1)
            out = self.head(ids.view(1, m), hidden.view(1, m, -1), position_ids=pos,
                            attention_mask=allowed.unsqueeze(0), cache=self.cache)
        self.cache.commit()  # kept until the crop in propose
        return out[0], rows

    def _grow_chain(self, root: torch.Tensor, depth: int, ctx: DraftContext) -> Draft:
        """A chain (a node budget of ``depth``): per depth the argmax (greedy) or one token drawn
        from the processed draft distribution ``q`` (sampling: ``Draft.q`` records it, mapped into
        the target vocabulary), then one mask-free one-token head step (each draft sees every
        earlier one: causal). The tree search's ranking and bookkeeping are not needed for a chain."""
        head = self.head
        d2t = head.draft_to_target
        greedy = ctx.sampling.greedy
        h = self._root_hidden.view(1, 1, -1)
        base = self.cache.length
        drafts, qs = [], []
        for d in range(depth):
            logits = head.compute_logits(h[:, -1])  # [1, Vd]
            if greedy:
                tok = logits.argmax(-1)  # [1] draft-vocabulary id
            else:
                q = probs_from_logits(logits, draft_params(ctx.sampling, self.draft_temperature))
                tok = sample(q, ctx.generator).view(1)
                qs.append(q)
            tok = tok if d2t is None else d2t[tok]
            drafts.append(tok)
            if d + 1 < depth:
                h = head.step(tok.view(1, 1), h, self.cache, position_ids=torch.full((1, 1), base + d, device=tok.device))
                self.cache.commit()  # kept until the crop in propose
        q_all = self._target_vocab(torch.cat(qs)).unsqueeze(0) if qs else None
        return Draft.chain(root.view(1).to(h.device), torch.cat(drafts).view(1, depth), q_all)

    def _target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Draft distributions ``[m, Vd]`` over the draft vocabulary as ``[m, V]`` over the target's
        (the drafts drafted in one C call keep the draft vocabulary: ``Draft.q_ids``)."""
        d2t = self.head.draft_to_target
        if d2t is None:
            return q
        return over_target_vocab(q, d2t, self.head.architecture["vocab_size"])

    def _grow_greedy(self, root: torch.Tensor, depth: int, budget: int) -> Draft:
        base = self.cache.length
        tok, par, keep = self.greedy_search(self._root_hidden, depth, self.top_k, budget,
                                            lambda ids, h, rows, d: self._step(ids, h, rows, base + d), topk_first)
        return subtree(root, tok, par, keep, None)

    def greedy_search(self, root_hidden: torch.Tensor, depth: int, k: int, budget: int, step, topk) -> tuple:
        """EAGLE-2's greedy tree from the root's head output ``[1, H]``: every shape fixed by
        (depth, k, budget), so the CUDA-graphed drafting runs this same search with its own ``step``
        (:mod:`~specfoundry.runtime.cuda_graph_draft`). ``step(ids [s], hidden [s, H], parent_rows
        [s, S], d)`` runs the ``s`` expanded nodes at depth offset ``d`` (position = first draft
        position + d) and returns their outputs and ancestor rows ``[s, S + s]``; ``topk(x, k)`` is
        :func:`topk_first` or a sync-free twin with the same result. Returns the candidates' target
        ids and parents (1-based, 0 = root) ``[M]`` and the kept candidates ``[budget]`` (sorted)."""
        head = self.head
        d2t = head.draft_to_target
        dev = root_hidden.device
        tokens, parents, scores = [], [], []  # per level, over nodes 1..N-1
        n_nodes = 1
        front_idx = torch.zeros(1, dtype=torch.long, device=dev)  # node ids of the frontier
        front_h = root_hidden  # [m, H]
        # scores only rank candidates (every draft is verified): float32, or the head's float64 in tests
        work = torch.promote_types(root_hidden.dtype, torch.float32)
        front_score = torch.zeros(1, dtype=work, device=dev)
        front_rows = torch.zeros(1, 0, dtype=torch.bool, device=dev)
        for d in range(1, depth + 1):
            top_v, top_i = topk(tree_log_probs(head.compute_logits(front_h), work), k)  # [m, k]
            m = front_idx.shape[0]
            child_tok = (top_i if d2t is None else d2t[top_i]).reshape(-1)
            child_score = (front_score[:, None] + top_v).reshape(-1)
            tokens.append(child_tok)
            parents.append(front_idx.view(m, 1).expand(m, k).reshape(-1))
            scores.append(child_score)
            child_idx = n_nodes + torch.arange(m * k, device=dev)
            n_nodes += m * k
            if d == depth:
                break
            # EAGLE-2: expand the top_k newest nodes by cumulative score
            sel = topk(child_score, min(k, m * k))[1].sort().values
            par = sel // k
            front_h, front_rows = step(child_tok[sel], front_h[par], front_rows[par], d - 1)
            front_idx, front_score = child_idx[sel], child_score[sel]
        score = torch.cat(scores)
        # keep the best `budget` nodes; the stable sort breaks ties by index (parents first), and
        # creation order is topological
        keep = torch.sort(-score, stable=True).indices[:budget].sort().values
        return torch.cat(tokens), torch.cat(parents), keep

    def _grow_sampling(self, root: torch.Tensor, depth: int, budget: int, ctx: DraftContext) -> Draft:
        head, k = self.head, self.top_k
        d2t = head.draft_to_target
        dev = self._root_hidden.device
        base = self.cache.length
        gen = ctx.generator
        tokens, parents, qs, logP = [], [], [], []
        n_nodes = 1
        remaining = budget
        front_idx = torch.zeros(1, dtype=torch.long, device=dev)
        front_h = self._root_hidden
        front_logP = torch.zeros(1, dtype=torch.float64, device=dev)
        front_rows = torch.zeros(1, 0, dtype=torch.bool, device=dev)
        for d in range(1, depth + 1):
            # drawn in the draft vocabulary (2k rows, not the target's 49k); q is mapped into the
            # target vocabulary once, for the finished tree
            q = probs_from_logits(head.compute_logits(front_h), draft_params(ctx.sampling, self.draft_temperature))  # [m, Vd]
            Vq = q.shape[-1]
            m = q.shape[0]
            # decide every node's child count before drawing any of them
            level = math.ceil(remaining / (depth - d + 1))
            cap = torch.clamp((q > 0).sum(-1), max=k)  # never more siblings than q has support
            kk = int(cap.max())
            sq = q.topk(kk, dim=-1).values.double()
            value = front_logP[:, None] + sq.clamp_min(1e-300).log()
            value = value.masked_fill(torch.arange(kk, device=dev)[None, :] >= cap[:, None], float("-inf"))
            take = min(level, int(cap.sum()))
            chosen = value.reshape(-1).topk(take).indices
            counts = torch.bincount(chosen // kk, minlength=m)
            remaining -= take
            # draw siblings in rank order, without replacement
            cur = q.clone()
            drawn_tok = torch.zeros(m, kk, dtype=torch.long, device=dev)
            drawn_q = q.new_zeros(m, kk, Vq)
            for j in range(int(counts.max()) if m else 0):
                act = (counts > j).nonzero().view(-1)
                cur_a = cur[act] / cur[act].sum(-1, keepdim=True)
                t = sample(cur_a, gen).view(-1)
                drawn_tok[act, j] = t
                drawn_q[act, j] = cur_a
                cur[act, t] = 0
            valid = torch.arange(kk, device=dev)[None, :] < counts[:, None]  # row-major = parent, rank
            rows_i, cols_j = valid.nonzero(as_tuple=True)
            child_draft = drawn_tok[rows_i, cols_j]  # draft-vocabulary ids
            child_tok = child_draft if d2t is None else d2t[child_draft]
            tokens.append(child_tok)
            parents.append(front_idx[rows_i])
            qs.append(drawn_q[rows_i, cols_j])
            child_logP = front_logP[rows_i] + q[rows_i, child_draft].double().clamp_min(1e-300).log()
            logP.append(child_logP)
            n_new = child_tok.shape[0]
            child_idx = n_nodes + torch.arange(n_new, device=dev)
            n_nodes += n_new
            if d == depth or remaining <= 0 or n_new == 0:
                break
            # which new nodes get children next: the top_k by path probability (any drawn value may
            # decide that; none decides whether a drawn node is kept)
            # (no more of them than the next level's node budget could serve)
            n_expand = min(k, n_new, math.ceil(remaining / (depth - d)))
            sel = child_logP.topk(n_expand).indices.sort().values
            par = rows_i[sel]
            front_h, front_rows = self._step(child_tok[sel], front_h[par], front_rows[par], base + d - 1)
            front_idx, front_logP = child_idx[sel], child_logP[sel]
        tok = torch.cat(tokens)
        keep = torch.arange(tok.shape[0], device=dev)
        q_all = self._target_vocab(torch.cat(qs))
        return subtree(root, tok, torch.cat(parents), keep, q_all)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """Queued ``[1, n_i, ...]`` tensors as one (usually there is one: no copy), None for none."""
    return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def topk_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k)`` (values, indices; largest first) with equal values in index order, which
    ``torch.topk`` leaves open: the tree search ranks bf16-derived scores, where ties are common,
    and its C twin (``cpu_layers.eagle3_draft``) breaks them by index."""
    vals, idx = x.topk(k, dim=-1)
    kth = vals[..., -1:]
    if bool(((x >= kth).sum(-1) > k).any()):  # ties across the cut: a full stable sort decides
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
        return x.gather(-1, order), order
    idx, o = idx.sort(dim=-1)  # ties inside the cut: index order, then a stable sort by value
    vals = vals.gather(-1, o)
    o = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, o), idx.gather(-1, o)


#: the EAGLE heads' CPU drafting weights unless load_drafter's ``head_weights`` says: "int8" or "bf16"
HEAD_WEIGHTS_ENV = "SPECFOUNDRY_HEAD_WEIGHTS"


def resolve_head_weights(value: str | None = None) -> str:
    """The heads' drafting weights: ``value``, else ``$SPECFOUNDRY_HEAD_WEIGHTS``, else ``"int8"``: the
    AVX-512 BF16 few-row products on int8 copies (per-output scales, :func:`.cpu_gemv.q8_pack`), which a
    drafting step reads in about half the time (it is bound by the bytes it reads); the same acceptance
    on the default head (docs/results.md, thirty-eighth session). Lossless either way: the verifier
    judges whatever the head drafts. ``"bf16"``: the weights as trained (the drafts of the bf16 head)."""
    choice = value or os.environ.get(HEAD_WEIGHTS_ENV) or "int8"
    if choice not in ("int8", "bf16"):
        raise ValueError(f"head_weights must be 'int8' or 'bf16', got {choice!r}")
    return choice


def _make(drafter_cls, source, target, architecture: dict | None = None, seed: int | None = 0,
          head_weights: str | None = None, **options):
    head_cls = drafter_cls.head_class
    int8 = resolve_head_weights(head_weights) == "int8"
    default_adaptive = True
    if source is None:
        head = head_cls.from_target(target, seed=seed, **(architecture or {}))
    else:
        if architecture:
            raise ValueError("architecture= only applies to a random-init head (source=None)")
        head = load_speculator(source, target)
        if not isinstance(head, head_cls):
            raise ValueError(f"{source}: holds a {head.type!r} speculator, not {drafter_cls.type!r}")
        # no shape named: the checkpoint's default (its measured runtime shape, else its tau shape);
        # a shape named: the tau shape under the caller's options
        cfg = read_config(source)
        calibrated = (cfg.get("training") or {}).get("draft_temperature")
        if any(k in options for k in _TREE_OPTIONS):
            cfg = {"training": {"drafter_options": (cfg.get("training") or {}).get("drafter_options")}}
        saved, default_adaptive = default_draft_shape(cfg)
        if calibrated is not None:  # measured on held-out text (runtime/calibrate.py); a caller's value wins
            saved["draft_temperature"] = calibrated["scale"]
        options = {**saved, **options}
    # the target engine as it is now: one built before a .to(device/dtype) holds the old device's
    # kernels (a CPU kernel for a head on CUDA failed on a GPU machine)
    current = getattr(target, "_engine", None)
    if current is not None and hasattr(head, "use_kernels"):
        head.use_kernels(current().kernels, int8=int8)  # the target engine's measured kernels for this machine/dtype
    drafter = drafter_cls(head, **options)
    drafter.default_adaptive = default_adaptive
    return drafter


_TREE_OPTIONS = DRAFT_SHAPE_KEYS


class Eagle3Drafter(EagleDrafter):
    type = "eagle3"
    head_class = Eagle3Head


@register_drafter("eagle")
def _make_eagle(source, target, **options) -> EagleDrafter:
    """``source``: an ``"eagle"`` checkpoint directory, or None for a random-init head."""
    return _make(EagleDrafter, source, target, **options)


@register_drafter("eagle3")
def _make_eagle3(source, target, **options) -> Eagle3Drafter:
    """``source``: an ``"eagle3"`` checkpoint directory, or None for a random-init head."""
    return _make(Eagle3Drafter, source, target, **options)
