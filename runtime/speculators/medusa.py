"""Medusa heads (type ``"medusa"``, Cai et al. 2024): the ``nn.Module`` only.

Scope: the module, its architecture schema for checkpoints, random init from a target and a
default static tree (:func:`default_medusa_choices`). The drafter that turns head logits into a
draft tree is ``runtime/drafters/medusa.py``.

``K`` heads read the target's final normed hidden state (hidden_states index ``L``) of the last
token whose features are known, i.e. the token *before* the root. The target's own ``lm_head``
on that state already produced the root, so head ``k`` (0-based) predicts the token ``k + 1``
steps after the root. Each head is ``num_layers`` residual blocks ``x + SiLU(Linear(x))``
followed by its own ``lm_head`` (initialised from the target's, trained and stored, as in
Medusa-1). The blocks' linear layers start at zero (as in Medusa), so an untrained head is the
target's ``lm_head``.

Reduced vocabulary (optional ``draft_vocab_size`` < ``vocab_size``, as EAGLE-3's draft
vocabulary): every head's ``lm_head`` covers only ``draft_vocab_size`` target tokens, listed by
the ``d2t`` buffer (draft id -> absolute target id, distinct, stored in the checkpoint and
validated on load) with ``t2d`` the mask of those ids over the target vocabulary. The heads then
return logits over the draft ids; the drafter maps them to target ids (and a sampled draft's
``q`` to a distribution over the whole target vocabulary, zero outside the draft vocabulary).
Without ``draft_vocab_size`` (older checkpoints) or with it equal to ``vocab_size`` the heads
are Medusa's original full-vocabulary ones and hold no map.
"""

from __future__ import annotations

import copy
import heapq
from typing import ClassVar

import torch
from torch import nn

from .eagle import seeded_init
from .vocab import set_draft_vocab

__all__ = ["ResBlock", "MedusaHeads", "default_medusa_choices", "fit_medusa_choices", "tree_accepted"]


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``; zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


MAX_HEAD_LAYERS = 16  # residual blocks per head (Medusa uses 1)


class MedusaHeads(nn.Module):
    type: ClassVar[str] = "medusa"
    ARCHITECTURE_SCHEMA: ClassVar[dict] = {
        "hidden_size": int,
        "vocab_size": int,
        "num_heads": int,  # K
        "num_layers": int,  # residual blocks per head
        "feature_layers": ("list", int),
        "draft_vocab_size": int,  # optional: each head's lm_head over this many target tokens (d2t)
    }
    ARCHITECTURE_OPTIONAL: ClassVar[frozenset] = frozenset({"draft_vocab_size"})

    def __init__(self, architecture: dict):
        super().__init__()
        self.architecture = copy.deepcopy(dict(architecture))
        a = self.architecture
        H, V = a["hidden_size"], a["vocab_size"]
        Vd = a.get("draft_vocab_size", V)
        # one distinct module per block and per head: `[ResBlock(H)] * n` would share one block
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(H) for _ in range(a["num_layers"])], nn.Linear(H, Vd, bias=False))
            for _ in range(a["num_heads"])
        )
        if Vd < V:  # persistent buffers: saved in the checkpoint, never cast by .to(dtype)
            self.register_buffer("d2t", torch.arange(Vd, dtype=torch.long))
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[:Vd] = True
            self.register_buffer("t2d", t2d)
        self.target_identity: dict | None = None
        self.drafter_options: dict = {}  # a loaded checkpoint's training.drafter_options

    @property
    def num_heads(self) -> int:
        return self.architecture["num_heads"]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.architecture["feature_layers"])

    @property
    def draft_vocab_size(self) -> int:
        """Rows of each head's ``lm_head`` (the target's vocabulary size for full-vocabulary heads)."""
        return self.architecture.get("draft_vocab_size", self.architecture["vocab_size"])

    def tree_choices(self) -> list[list[int]]:
        """The static tree this checkpoint was evaluated with (its stored ``choices``, e.g. fitted to
        its heads' measured ranks by training), else :func:`default_medusa_choices`."""
        stored = self.drafter_options.get("choices")
        return [list(c) for c in stored] if stored else default_medusa_choices(self.num_heads)

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """``[draft_vocab_size]`` long target ids, or None for full-vocabulary heads."""
        return getattr(self, "d2t", None)

    def set_draft_vocab(self, token_ids) -> None:
        """Set the reduced vocabulary: ``token_ids`` (target ids, distinct, ``draft_vocab_size`` of
        them). The heads' ``lm_head`` rows are not touched (see :meth:`from_target`)."""
        if self.draft_to_target is None:
            raise ValueError("these Medusa heads cover the full vocabulary (no draft_vocab_size): nothing to map")
        set_draft_vocab(self.d2t, self.t2d, token_ids, self.architecture["vocab_size"])

    @classmethod
    def tensor_problems(cls, tensors: dict, arch: dict | None) -> list[tuple[str, str]]:
        """Index integrity of the reduced vocabulary (as EAGLE-3's): ``d2t`` distinct integer
        target ids in ``[0, vocab_size)``, ``t2d`` the mask of exactly those ids."""
        from .eagle import Eagle3Head

        return Eagle3Head.tensor_problems(tensors, arch)

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0][-1].weight.dtype

    @property
    def device(self) -> torch.device:
        return self.heads[0][-1].weight.device

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[..., H]`` (target feature ``L``) -> logits ``[..., K, draft_vocab_size]``
        (over the draft ids ``d2t`` lists when the vocabulary is reduced)."""
        hidden = hidden.to(self.device, self.dtype)
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    @classmethod
    def architecture_problems(cls, arch: dict, target=None) -> list[tuple[str, str]]:
        out = []
        from ..adaptive import MAX_DRAFT_DEPTH

        for k in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            if arch[k] < (0 if k == "num_layers" else 1):
                out.append((k, f"must be >= {0 if k == 'num_layers' else 1}, got {arch[k]}"))
        # head k drafts depth k + 1: more heads than the deepest allowed draft are never used
        if arch["num_heads"] > MAX_DRAFT_DEPTH:
            out.append(("num_heads", f"must be <= {MAX_DRAFT_DEPTH} (the deepest draft), got {arch['num_heads']}"))
        if arch["num_layers"] > MAX_HEAD_LAYERS:
            out.append(("num_layers", f"must be <= {MAX_HEAD_LAYERS}, got {arch['num_layers']}"))
        if "draft_vocab_size" in arch and not 1 <= arch["draft_vocab_size"] <= arch["vocab_size"]:
            out.append(("draft_vocab_size",
                        f"must be in [1, vocab_size={arch['vocab_size']}], got {arch['draft_vocab_size']}"))
        if len(arch["feature_layers"]) != 1:
            out.append(("feature_layers", f"Medusa reads exactly one feature layer, got {arch['feature_layers']}"))
        if target is not None:
            if arch["hidden_size"] != target.hidden_size:
                out.append(("hidden_size", f"{arch['hidden_size']} != target hidden size {target.hidden_size}"))
            if arch["vocab_size"] != target.vocab_size:
                out.append(("vocab_size", f"{arch['vocab_size']} != target vocabulary {target.vocab_size}"))
            if len(arch["feature_layers"]) == 1 and arch["feature_layers"][0] != target.num_layers:
                # the heads' lm_heads start as the target's, which reads the final normed state
                out.append(("feature_layers", f"Medusa reads the final normed feature [{target.num_layers}], got {arch['feature_layers']}"))
        return out

    @classmethod
    def default_architecture(cls, target) -> dict:
        return {"hidden_size": int(target.hidden_size), "vocab_size": int(target.vocab_size), "num_heads": 4,
                "num_layers": 1, "feature_layers": [int(target.num_layers)]}

    @classmethod
    def build(cls, architecture: dict, target) -> "MedusaHeads":
        """Untrained heads in float32 on CPU (``load_speculator`` overwrites the weights)."""
        heads = cls(architecture)
        heads.target_identity = target.identity()
        return heads

    @classmethod
    def from_target(cls, target, seed: int | None = 0, draft_token_ids=None, **architecture) -> "MedusaHeads":
        """Random-init heads for ``target`` (defaults: 4 heads, 1 block each, full vocabulary);
        every head's ``lm_head`` starts as a copy of the target's (its ``d2t`` rows with a
        reduced vocabulary: ``draft_vocab_size``, and ``draft_token_ids`` the target ids it
        covers, default the first ``draft_vocab_size`` ids)."""
        if draft_token_ids is not None and architecture.get("draft_vocab_size") is None:
            architecture = {**architecture, "draft_vocab_size": len(draft_token_ids)}
        if architecture.get("draft_vocab_size", 0) is None:
            architecture.pop("draft_vocab_size")
        arch = cls.default_architecture(target)
        unknown = sorted(set(architecture) - set(arch) - cls.ARCHITECTURE_OPTIONAL)
        if unknown:
            raise ValueError(f"unknown medusa architecture option(s) {unknown}; allowed: {sorted(arch)}")
        arch.update(copy.deepcopy(architecture))
        problems = cls.architecture_problems(arch, target)
        if problems:
            raise ValueError("invalid medusa architecture: " + "; ".join(f"{k}: {m}" for k, m in problems))
        with seeded_init(seed):
            heads = cls.build(arch, target)
        heads = heads.to(target.device, target.dtype)  # copy the target's lm_head at full precision
        if draft_token_ids is not None:
            heads.set_draft_vocab(draft_token_ids)
        w = target.lm_head.weight.detach()
        if heads.draft_to_target is not None:
            w = w[heads.draft_to_target.to(w.device)]
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(w)
        return heads


# Rough acceptance of the rank-r candidate of a head (decaying with rank) used only to shape the
# default static tree: paths are ranked by the product over their depths.
_RANK_WEIGHT = (0.55, 0.15, 0.07, 0.04, 0.025, 0.015, 0.01, 0.007, 0.005, 0.003)


def default_medusa_choices(num_heads: int, num_nodes: int = 24) -> list[list[int]]:
    """A static tree of ``num_nodes`` draft nodes for ``num_heads`` heads: the ``num_nodes``
    paths with the largest product of per-rank weights. Products shrink along a path and with
    rank, so the set is closed under prefixes and under lower sibling ranks."""
    if num_heads < 1 or num_nodes < 1:
        return [] if num_heads < 1 else [[0]]
    w = _RANK_WEIGHT
    heap = [(-w[r], (r,)) for r in range(len(w))]
    heapq.heapify(heap)
    out: list[list[int]] = []
    while heap and len(out) < num_nodes:
        negv, path = heapq.heappop(heap)
        out.append(list(path))
        if len(path) < num_heads:
            for r in range(len(w)):
                heapq.heappush(heap, (negv * w[r], path + (r,)))
    return out


def tree_accepted(choices: list[list[int]], prefix_counts: dict, positions: int) -> float:
    """Expected accepted draft tokens per step of the static tree ``choices`` on measured data:
    ``prefix_counts[path]`` is how many of ``positions`` positions had every head of ``path``
    right at that path's ranks (a node is accepted exactly when its path is), so the expectation
    is the sum over the tree's nodes. tau = 1 + this."""
    return sum(prefix_counts.get(tuple(c), 0) for c in choices) / max(positions, 1)


def fit_medusa_choices(prefix_counts: dict, num_heads: int, num_nodes: int = 24) -> list[list[int]]:
    """The static tree of ``num_nodes`` paths that maximises :func:`tree_accepted` on the measured
    ``prefix_counts`` (Medusa's tree search from its heads' measured accuracies, but on joint
    counts instead of a product of per-head rates, so heads that fail together are priced as
    such). A path is never counted more often than its prefix, so the best ``num_nodes`` by count
    (ties: shorter, then lower ranks) are prefix-closed; with fewer measured paths than nodes the
    rest comes from :func:`default_medusa_choices`."""
    measured = sorted(((n, p) for p, n in prefix_counts.items() if n > 0 and 1 <= len(p) <= num_heads),
                      key=lambda t: (-t[0], len(t[1]), t[1]))
    out = [list(p) for _, p in measured[:num_nodes]]
    have = {tuple(c) for c in out}
    for c in default_medusa_choices(num_heads, 10 * num_nodes):
        if len(out) >= num_nodes:
            break
        if tuple(c) not in have and (len(c) == 1 or tuple(c[:-1]) in have):
            out.append(c)
            have.add(tuple(c))
    return out
