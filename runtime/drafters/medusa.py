"""Medusa drafter (``"medusa"``): a static tree filled from the Medusa heads' logits.

Scope: turning one :class:`~specfoundry.runtime.speculators.MedusaHeads` call into a draft tree
for one sequence (batch size 1). The heads read the target's final normed feature of the last
token with known features (the token before the root); head ``k`` proposes the token ``k + 1``
steps after the root, so a node at depth ``d`` takes its token from head ``d - 1``.

The tree is static: ``choices`` (Medusa's rank paths, see :func:`tree_from_choices`), default
the checkpoint's own (a recipe's tree, or one fitted to the heads by training), else
:func:`~specfoundry.runtime.speculators.default_medusa_choices` for the heads (24 draft nodes).
``ctx.max_depth``/``ctx.max_nodes`` truncate it to a prefix of the depth-then-choice order,
which stays closed under ancestors.

Greedy mode: the node with path ``[r_1, .., r_d]`` gets head ``d - 1``'s rank-``r_d`` token.
Sampling mode: a node's children (fixed in number by the static tree) are drawn in index order
from ``q_d = probs_from_logits(head_{d-1} logits)`` without replacement and ``Draft.q`` records
each one's distribution; children beyond the support of ``q_d`` are left out (with their
subtrees) before anything is drawn.

Reduced-vocabulary heads (``draft_vocab_size`` < the target's vocabulary, see
:class:`~specfoundry.runtime.speculators.MedusaHeads`): ranks are taken over the draft ids and
mapped to target ids through ``d2t``; in sampling mode ``q_d`` is computed over the draft ids
and scattered into the target vocabulary (zero outside the draft vocabulary) before anything is
drawn, so every token and every ``Draft.q`` row is in target ids and verification is unchanged.
"""

from __future__ import annotations

import torch

from ..adaptive import MAX_DRAFT_NODES
from ..sampling import probs_from_logits, sample
from ..speculators import MedusaHeads, load_speculator
from ..tree import Draft, over_target_vocab, tree_depths, tree_from_choices
from .base import DraftContext, Drafter, register_drafter

__all__ = ["MedusaDrafter"]


class MedusaDrafter(Drafter):
    type = "medusa"

    def __init__(self, heads: MedusaHeads, *, choices: list[list[int]] | None = None):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"the medusa drafter needs MedusaHeads, got {type(heads).__name__}")
        K = heads.num_heads
        choices = heads.tree_choices() if choices is None else [list(c) for c in choices]
        if not choices:
            raise ValueError("medusa choices must hold at least one path")
        if len(choices) + 1 > MAX_DRAFT_NODES:
            raise ValueError(f"medusa choices give {len(choices) + 1} tree nodes, more than the limit {MAX_DRAFT_NODES}")
        if any(not c or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in c) for c in choices):
            raise ValueError("medusa choices must be non-empty lists of non-negative integer ranks")
        V = heads.draft_vocab_size
        if any(r >= V for c in choices for r in c):
            raise ValueError(f"medusa choices hold a rank beyond the heads' vocabulary of {V} tokens")
        too_deep = [c for c in choices if len(c) > K]
        if too_deep:
            raise ValueError(f"medusa choices deeper than the {K} heads: {too_deep[:3]}")
        self.heads = heads.eval()
        self.parents, self.paths = tree_from_choices(choices)  # [N] static parents, node i <-> paths[i-1]
        self.depths = tree_depths(self.parents.view(1, -1))[0]
        self.ranks = torch.tensor([0] + [p[-1] for p in self.paths], dtype=torch.long)
        self.feature_layers = tuple(heads.feature_layers)
        self.default_depth = int(self.depths.max())
        self.default_nodes = int(self.parents.shape[0])
        self._num_tokens = 0
        self._last: torch.Tensor | None = None  # [1, H] feature of the token before the root

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        if prompt_ids.shape[0] != 1:
            raise ValueError("the medusa drafter serves one sequence (batch size 1)")
        self._num_tokens = prompt_ids.shape[1]
        self._last = None
        self._take(features, prompt_ids.shape[1] - 1)

    def commit(self, new_tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self._num_tokens += new_tokens.shape[1]
        self._take(features, new_tokens.shape[1])

    def _take(self, features, n: int) -> None:
        if n == 0:
            return
        if features is None or features.shape[1] != n:
            raise ValueError(f"the medusa drafter needs target features for {n} tokens (feature_layers={self.feature_layers})")
        self._last = features[:, -1, 0]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        if ctx.tokens.shape[0] != 1 or ctx.tokens.shape[1] != self._num_tokens:
            raise RuntimeError(f"context has {tuple(ctx.tokens.shape)} tokens but the drafter committed "
                               f"{self._num_tokens}: begin/commit were not called for every step")
        root = ctx.tokens[:, -1]
        if self._last is None or ctx.max_depth < 1 or ctx.max_nodes < 2:
            return Draft.root_only(root)
        logits = self.heads(self._last)[0]  # [K, V]
        dev = logits.device
        # truncate the static tree: depth cap, then a prefix (both keep it ancestor-closed)
        keep = (self.depths <= ctx.max_depth).nonzero().view(-1)[: ctx.max_nodes]
        parents = _reindex(self.parents, keep)
        depths = self.depths[keep]
        if ctx.sampling.greedy:
            ranks = self.ranks[keep].to(dev)
            top = logits.topk(int(ranks.max()) + 1, dim=-1).indices  # [K, R]
            d = depths.to(dev)
            tokens = top[(d - 1).clamp(min=0), ranks]
            d2t = self.heads.draft_to_target
            if d2t is not None:  # draft ids -> target ids
                tokens = d2t.to(dev)[tokens]
            tokens[0] = root[0]
            return Draft(tokens.view(1, -1), parents.view(1, -1).to(dev))
        return self._sample(root, logits, parents, depths, ctx)

    def _sample(self, root, logits, parents, depths, ctx: DraftContext) -> Draft:
        q_depth = probs_from_logits(logits, ctx.sampling)  # [K, V] (draft ids with a reduced vocabulary)
        d2t = self.heads.draft_to_target
        if d2t is not None:  # into the target vocabulary, where verification compares q with p
            q_depth = over_target_vocab(q_depth, d2t, self.heads.architecture["vocab_size"])
        support = (q_depth > 0).sum(-1).tolist()
        N = parents.shape[0]
        par = parents.tolist()
        dep = depths.tolist()
        # leave out children beyond their parent's support, decided before any draw
        kept = [True] * N
        n_children = [0] * N
        for i in range(1, N):
            p = par[i]
            if not kept[p] or n_children[p] >= support[dep[i] - 1]:
                kept[i] = False
                continue
            n_children[p] += 1
        idx = torch.tensor([i for i in range(N) if kept[i]], dtype=torch.long)
        parents = _reindex(parents, idx)
        par = parents.tolist()
        dep = depths[idx].tolist()
        N = len(par)
        V = q_depth.shape[-1]
        tokens = [int(root[0])] + [0] * (N - 1)
        q = q_depth.new_zeros(N, V)
        remaining = {}  # parent -> its children's current (sibling-reduced) distribution
        for i in range(1, N):  # index order = sibling order within each parent
            p = par[i]
            cur = remaining.get(p)
            if cur is None:
                cur = q_depth[dep[i] - 1].clone()
            cur = cur / cur.sum()
            t = int(sample(cur, ctx.generator))
            tokens[i] = t
            q[i] = cur
            cur = cur.clone()
            cur[t] = 0
            remaining[p] = cur
        dev = logits.device
        return Draft(torch.tensor([tokens], dtype=torch.long, device=dev), parents.view(1, -1).to(dev), q.unsqueeze(0))


def _reindex(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Parents of the sub-tree made of nodes ``keep`` (sorted, ancestor-closed, 0 included)."""
    new_id = torch.full((parents.shape[0],), -1, dtype=torch.long)
    new_id[keep] = torch.arange(keep.shape[0])
    old = parents[keep]
    out = torch.where(old >= 0, new_id[old.clamp(min=0)], old)
    if bool((out[1:] < 0).any()):
        raise AssertionError("medusa tree truncation is not closed under ancestors")
    return out


@register_drafter("medusa")
def _make_medusa(source, target, architecture: dict | None = None, seed: int | None = 0, **options) -> MedusaDrafter:
    """``source``: a ``"medusa"`` checkpoint directory, or None for random-init heads."""
    if source is None:
        heads = MedusaHeads.from_target(target, seed=seed, **(architecture or {}))
    else:
        if architecture:
            raise ValueError("architecture= only applies to random-init heads (source=None)")
        heads = load_speculator(source, target)
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"{source}: holds a {heads.type!r} speculator, not 'medusa'")
    return MedusaDrafter(heads, **options)
