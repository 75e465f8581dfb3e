"""Prompt lookup first, a model drafter otherwise: :class:`LookupFirstDrafter`.

Why: the two kinds of drafter win on different text. On Spec-Bench (docs/results.md) prompt
lookup gave 1.90x plain decoding on translation-style copying, where an EAGLE head trained on
chat gave 0.78-0.95x, while on open-ended answers the head accepts more and lookup finds
nothing. Per step this drafter proposes the lookup continuation when the context's suffix of at
least ``min_match`` tokens occurred earlier (a long match predicts a copy well, and drafting it
costs no model forward), else whatever the wrapped drafter proposes.

The generator asks :meth:`LookupFirstDrafter.pre_draft` before its adaptive controller (an
optional drafter hook): a lookup draft is taken whatever shape the controller would have chosen
(even plain decoding), and the controller neither chooses nor learns from those steps, so its
acceptance and cost estimates describe the wrapped drafter alone.

The choice reads only committed tokens, never a value still to be drawn, so it cannot change
what the verifier emits: greedy output and the sampling distribution are the target's (a lookup
draft is deterministic, ``Draft.q is None``, which the sampling verifier handles). Both drafters
see every ``begin``/``commit``, so the wrapped one's state (an EAGLE head's KV over committed
pairs) stays complete across lookup steps; its queued pairs run at its next proposal.
"""

from __future__ import annotations

import copy

import torch

from ..adaptive import MAX_DRAFT_DEPTH, check_int
from ..tree import Draft
from .base import DraftContext, Drafter
from .ngram import NgramDrafter

__all__ = ["LookupFirstDrafter", "with_lookup"]


def with_lookup(drafter: Drafter | None, min_match: int) -> Drafter | None:
    """``drafter`` behind prompt lookup on ``min_match``-token matches (the CLIs' ``--prompt-lookup``);
    unchanged for ``min_match`` 0, no drafter, or the ``ngram`` drafter (prompt lookup already)."""
    min_match = check_int("--prompt-lookup", min_match, 0, 64)
    if drafter is None or min_match == 0 or drafter.type == "ngram":
        return drafter
    return LookupFirstDrafter(drafter, min_match=min_match)


class LookupFirstDrafter(Drafter):
    """``inner``'s drafts, except when prompt lookup matches ``>= min_match`` suffix tokens.

    ``lookup_depth`` caps the lookup chain (default 5, the ``ngram`` drafter's; a copy is cheap to
    draft and usually long); ``inner``'s own depth and node budget still cap its proposals.
    ``lookups``/``model_drafts`` count the steps each source drafted (for reports)."""

    def __init__(self, inner: Drafter, *, min_match: int = 2, max_ngram: int = 3, lookup_depth: int = 5):
        if not isinstance(inner, Drafter):
            raise TypeError(f"inner must be a Drafter, got {type(inner).__name__}")
        min_match = check_int("min_match", min_match, 1, 64)
        max_ngram = check_int("max_ngram", max(max_ngram, min_match), 1, 64)
        lookup_depth = check_int("lookup_depth", lookup_depth, 1, MAX_DRAFT_DEPTH)
        self.inner = inner
        self.lookup = NgramDrafter(max_ngram=max_ngram, min_ngram=min_match, depth=lookup_depth)
        self.type = f"{inner.type}+lookup"
        self.feature_layers = tuple(inner.feature_layers)
        self.default_depth = max(inner.default_depth, lookup_depth)
        self.default_nodes = max(inner.default_nodes, lookup_depth + 1)
        self.default_adaptive = inner.default_adaptive
        self.lookups = 0  # steps drafted by lookup
        self.model_drafts = 0  # steps drafted by ``inner``
        self._missed_at = -1  # context length at which the last lookup found nothing

    def fork(self) -> "LookupFirstDrafter":
        twin = copy.copy(self)
        twin.inner, twin.lookup = self.inner.fork(), self.lookup.fork()
        return twin

    def use_cuda_graphs(self, on: bool, capture: bool | None = None) -> None:
        """``inner``'s static-shape drafting where it has one (the lookup chain needs no model)."""
        inner = getattr(self.inner, "use_cuda_graphs", None)
        if callable(inner):
            inner(on, capture)

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        self._missed_at = -1
        self.lookup.begin(prompt_ids)
        self.inner.begin(prompt_ids, features)

    def pre_draft(self, tokens: torch.Tensor, max_depth: int, root_id: int | None = None) -> Draft | None:
        """The lookup chain (at most ``max_depth`` and ``lookup_depth`` tokens) rooted at
        ``tokens[:, -1]`` (``root_id``: that id as a host int, where the caller has it), or None when
        the context's suffix has no earlier ``min_match``-token occurrence."""
        k = min(max_depth, self.lookup.default_depth)
        if k < 1:
            return None
        found = self.lookup.lookup(k)  # most steps find nothing: no Draft (~0.05 ms of tensor ops) then
        if not found:
            self._missed_at = tokens.shape[1]
            return None
        self.lookups += 1
        return self.lookup.chain(tokens[:, -1], k, found, root_id)

    def propose(self, ctx: DraftContext) -> Draft:
        if self._missed_at != ctx.tokens.shape[1]:  # not already looked up at this length (pre_draft)
            draft = self.pre_draft(ctx.tokens, min(ctx.max_depth, ctx.max_nodes - 1), ctx.root_id)
            if draft is not None:
                return draft
        self.model_drafts += 1
        return self.inner.propose(ctx)

    def commit(self, new_tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self.lookup.commit(new_tokens)
        self.inner.commit(new_tokens, features)
