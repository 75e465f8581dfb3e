"""Comparing a speculative greedy run with the target's own greedy run.

Exact equality is the expectation. A batched tree forward and a single-token forward can round
differently, so a greedy argmax may flip where the two tokens' logits are within rounding of
each other; :func:`compare_greedy` finds the first divergence and decides whether rounding
explains it, so callers can report a near-tie instead of hiding or loosening it:

- float32/float64 targets: the plain run's top-2 gap there is below ``max(1e-4, 2 ulp)``.
- bfloat16/float16 targets: errors build up through every layer, so the ulp of the final
  logit says little (measured on SmolLM2-135M in bf16: flips between tokens 0.03-0.12 apart in
  float32, at logits of 1 to 30). The context is recomputed in float32 (a float32 copy of the
  target, made once and cached on it); the flip is rounding when the two tokens' float32 logits
  differ by at most twice the bf16-vs-fp32 logit error measured at that very position. A
  verifier that accepted a token the target does not prefer fails this: its float32 logit lies
  well below the top one.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from .target import TargetModel

NEAR_TIE_GAP = 1e-4


@dataclass
class GreedyComparison:
    identical: bool
    first_divergence: int | None = None  # index into the generated tokens
    top2_gap: float | None = None  # plain run's top-2 logit gap at that step (model dtype)
    near_tie: bool = False  # divergence explained by rounding
    reference_gap: float | None = None  # low-precision targets: |fp32 logit(plain) - fp32 logit(spec)|
    rounding_error: float | None = None  # low-precision targets: max |logit - fp32 logit| at that step

    @property
    def ok(self) -> bool:
        return self.identical or self.near_tie

    def as_dict(self) -> dict:
        return asdict(self)


def _fp32_reference(target: TargetModel) -> TargetModel:
    ref = getattr(target, "_fp32_reference", None)
    if ref is None:
        ref = TargetModel(copy.deepcopy(target.model).float(), target.tokenizer, name=target.name)
        target._fp32_reference = ref
    return ref


def _last_logits(target: TargetModel, ids: list[int]) -> torch.Tensor:
    ctx = torch.tensor([ids], dtype=torch.long, device=target.device)
    return target.forward(ctx, target.new_cache(), logits_for=torch.tensor([ctx.shape[1] - 1])).logits[0, -1]


def compare_greedy(target: TargetModel, prompt_ids: list[int], spec_ids: list[int], plain_ids: list[int],
                   gap: float = NEAR_TIE_GAP) -> GreedyComparison:
    n = min(len(spec_ids), len(plain_ids))
    first = next((i for i in range(n) if spec_ids[i] != plain_ids[i]), None)
    if first is None:
        if len(spec_ids) == len(plain_ids):
            return GreedyComparison(True)
        first = n  # one stopped early (eos) where the other did not: a real difference
        return GreedyComparison(False, first, None, False)
    ctx = list(prompt_ids) + list(plain_ids[:first])
    raw = _last_logits(target, ctx)
    top2 = torch.topk(raw.double(), 2).values
    g = float(top2[0] - top2[1])
    if raw.dtype in (torch.float32, torch.float64):
        ulp = torch.finfo(raw.dtype).eps * abs(float(top2[0]))
        return GreedyComparison(False, first, g, g < max(gap, 2 * ulp))
    ref = _last_logits(_fp32_reference(target), ctx).double()
    err = float((raw.double() - ref).abs().max())
    ref_gap = abs(float(ref[plain_ids[first]] - ref[spec_ids[first]]))
    return GreedyComparison(False, first, g, ref_gap <= max(gap, 2 * err), reference_gap=ref_gap, rounding_error=err)
