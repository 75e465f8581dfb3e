"""Sampling parameters and the one logits processor shared by drafts and the target.

Lossless speculative sampling needs the draft distribution q and the target distribution p
to be produced by the *same* processing (temperature, top-k, top-p); both go through
:func:`probs_from_logits`. Temperature 0 means greedy (argmax) decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        # one sentence per bad value here, not a failure deep inside torch.multinomial
        from .adaptive import check_int, check_real

        object.__setattr__(self, "temperature", check_real("temperature", self.temperature, 0.0))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", check_int("top_k", self.top_k, 1))
        if self.top_p is not None:
            top_p = check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
            object.__setattr__(self, "top_p", top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the sampling distribution over the last dim of ``logits`` (any leading shape).

    Computed in float32 at least (float64 stays float64) so that draft and target
    probabilities are comparable. Greedy params give a one-hot at the argmax.
    """
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(work_dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(work_dtype)
    scaled = logits / params.temperature
    overflow = ~torch.isfinite(scaled.amax(-1, keepdim=True))
    if bool(overflow.any()):
        # rows where the temperature is so small that the scaled logits overflow (softmax would
        # give NaN) take the T -> 0 limit: uniform over their maximal logits
        top = logits == logits.amax(-1, keepdim=True)
        limit = torch.zeros_like(scaled).masked_fill(~top, float("-inf"))
        scaled = torch.where(overflow, limit, scaled)
    logits = scaled
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it is kept)
        drop_sorted = (cum - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[..., V]`` -> ``[...]`` (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])
