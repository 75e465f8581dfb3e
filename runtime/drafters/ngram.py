"""Prompt-lookup drafter (``ngram``): no model, proposes what followed the latest earlier
occurrence of the current suffix in prompt + output.

Proposals are deterministic (``Draft.q is None``: a one-hot), which the sampling verifier
handles losslessly. An incremental index (n-gram -> latest follower position) makes each
proposal O(max_ngram) instead of a scan over the context.
"""

from __future__ import annotations

import torch

from ..adaptive import MAX_DRAFT_DEPTH, check_int
from ..tree import Draft
from .base import DraftContext, Drafter, register_drafter


class NgramDrafter(Drafter):
    type = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, depth: int = 5):
        depth = check_int("depth", depth, 1, MAX_DRAFT_DEPTH)
        max_ngram = check_int("max_ngram", max_ngram, 1, 64)
        min_ngram = check_int("min_ngram", min_ngram, 1, 64)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.default_depth = depth
        self.default_nodes = depth + 1
        self._tokens: list[int] = []
        self._index: list[dict[tuple, int]] = []

    def _append(self, toks: list[int]) -> None:
        for t in toks:
            j = len(self._tokens)  # position of the token being appended (the follower)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if j - n >= 0:
                    self._index[n][tuple(self._tokens[j - n : j])] = j
            self._tokens.append(t)

    def begin(self, prompt_ids: torch.Tensor, features=None) -> None:
        if prompt_ids.shape[0] != 1:
            raise ValueError("the ngram drafter serves one sequence (batch size 1)")
        self._tokens = []
        self._index = [dict() for _ in range(self.max_ngram + 1)]
        self._append(prompt_ids[0].tolist())

    def lookup(self, k: int) -> list[int]:
        L = len(self._tokens)
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            j = self._index[n].get(tuple(self._tokens[L - n :]))
            if j is not None:
                return self._tokens[j : j + k]
        return []

    def chain(self, root: torch.Tensor, k: int, found: list[int] | None = None, root_id: int | None = None) -> Draft:
        """The lookup continuation (at most ``k`` tokens; none without a match; ``found``: the
        :meth:`lookup` the caller already made) as a chain below ``root`` ``[1]`` (``root_id``: its id
        as a host int, where the caller has it: the draft is then made from host lists)."""
        if found is None:
            found = self.lookup(k) if k > 0 else []
        if root_id is not None:
            return Draft.host_chain([root_id] + found, root.device)
        drafts = torch.tensor([found], dtype=torch.long, device=root.device).view(1, len(found))
        return Draft.chain(root, drafts)

    def propose(self, ctx: DraftContext) -> Draft:
        return self.chain(ctx.tokens[:, -1], min(ctx.max_depth, ctx.max_nodes - 1), root_id=ctx.root_id)

    def commit(self, new_tokens: torch.Tensor, features=None) -> None:
        self._append(new_tokens[0].tolist())


@register_drafter("ngram")
def _make_ngram(source, target, **options) -> NgramDrafter:
    if source is not None:
        raise ValueError("the ngram drafter takes no checkpoint")
    return NgramDrafter(**options)
