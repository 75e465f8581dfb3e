"""Comparing a speculative greedy run with the target's own greedy run.

Exact equality is the expectation. A batched tree forward and a single-token forward can
round differently, so a greedy argmax may flip where the top-2 logit gap is within rounding;
:func:`compare_greedy` finds the first divergence and measures the plain run's top-2 gap
there, so callers can report a rounding near-tie instead of hiding or loosening it. What
counts as rounding depends on the dtype: 1e-4 in float32, but a bfloat16 logit of ~20 is only
resolved to ~0.125, so the bound is ``max(1e-4, 2 ulp of the top logit in the model dtype)``
(exact ties, gap 0, happen there too).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .target import TargetModel

NEAR_TIE_GAP = 1e-4


@dataclass
class GreedyComparison:
    identical: bool
    first_divergence: int | None = None  # index into the generated tokens
    top2_gap: float | None = None  # plain run's top-2 logit gap at that step
    near_tie: bool = False  # divergence explained by rounding (gap < NEAR_TIE_GAP)

    @property
    def ok(self) -> bool:
        return self.identical or self.near_tie

    def as_dict(self) -> dict:
        return asdict(self)


def compare_greedy(target: TargetModel, prompt_ids: list[int], spec_ids: list[int], plain_ids: list[int],
                   gap: float = NEAR_TIE_GAP) -> GreedyComparison:
    n = min(len(spec_ids), len(plain_ids))
    first = next((i for i in range(n) if spec_ids[i] != plain_ids[i]), None)
    if first is None:
        if len(spec_ids) == len(plain_ids):
            return GreedyComparison(True)
        first = n  # one stopped early (eos) where the other did not: a real difference
        return GreedyComparison(False, first, None, False)
    ctx = torch.tensor([list(prompt_ids) + list(plain_ids[:first])], dtype=torch.long)
    cache = target.new_cache()
    raw = target.forward(ctx, cache, logits_for=torch.tensor([ctx.shape[1] - 1])).logits[0, -1]
    top2 = torch.topk(raw.double(), 2).values
    g = float(top2[0] - top2[1])
    ulp = torch.finfo(raw.dtype).eps * abs(float(top2[0])) if raw.dtype.is_floating_point else 0.0
    return GreedyComparison(False, first, g, g < max(gap, 2 * ulp))
