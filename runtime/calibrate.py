"""The temperature a trained EAGLE head draws its drafts at when a request samples, measured on text.

Why: a draft drawn from ``q`` is accepted with probability ``sum_x min(p(x), q(x))`` (``p``: the
target's distribution at the request's temperature T), and verification stays exact whatever ``q``
is, since ``Draft.q`` records the distribution each draft was really drawn from. The head's own
softmax at T is one choice of ``q``, not the best: a head distilled from the target hedges where it is
unsure (its ``q`` is flatter than ``p``), so drawing at a lower temperature puts more of ``q`` where ``p``
is. Measured with the default head on 26 Spec-Bench first turns (the first draft, the same contexts;
docs/results.md, thirty-seventh session): at T=1 acceptance 0.259 at the head's T, 0.274 at 0.7 T,
0.224 at 1.25 T; at T=0.7 0.266 -> 0.274 (0.7 x); at T=0.4 0.298 -> 0.304 (0.5-0.6 x).

:func:`measure_draft_temperature`: for each prompt the target's own continuation is sampled (plain
decoding, once per temperature), then the target and the head run teacher-forced over prompt and
continuation. At every continuation position the head's logits for its first draft (from the pair
before it, as for a drafting step's root) and the target's logits there give the acceptance
``sum min(p_T, q_cT)`` for each scale ``c`` of the grid. The chosen scale has the best mean over all
positions of all temperatures (ties: the one nearest 1). Requests with top-k / top-p draw at the same
scale; the measurement uses the temperature alone. Deeper drafts see the same head and are assumed to
want the same scale (the measurement reads the first draft only: it needs no sampling of drafts).
:func:`~specfoundry.runtime.speculators.checkpoint.set_draft_temperature` stores the result as
``training.draft_temperature``, which ``load_drafter`` applies (``EagleDrafter(draft_temperature=)``).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from .adaptive import check_real

__all__ = ["DRAFT_TEMPERATURE_SCALES", "acceptance_by_scale", "choose_scale", "measure_draft_temperature"]

#: the scales of the request's temperature tried (1: the head's own softmax at T)
DRAFT_TEMPERATURE_SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)


def acceptance_by_scale(target_logits: torch.Tensor, draft_logits: torch.Tensor, d2t: torch.Tensor | None,
                        temperature: float, scales=DRAFT_TEMPERATURE_SCALES) -> torch.Tensor:
    """Summed first-draft acceptance ``sum_positions sum_x min(p_T(x), q_cT(x))`` per scale ``c``:
    ``target_logits`` ``[M, V]``, ``draft_logits`` ``[M, Vd]`` over the draft vocabulary (``d2t``
    ``[Vd]`` its target ids; None: the target's vocabulary), one row per position. Returns ``[len(scales)]``
    fp64 (sums, not means, so sets of positions add up)."""
    check_real("temperature", temperature, 0.0, lo_open=True)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    if d2t is not None:  # q is zero outside the draft vocabulary, so only its columns count
        p = p[:, d2t]
    ql = draft_logits.float()
    out = [torch.minimum(p, torch.softmax(ql / (c * temperature), dim=-1)).sum(-1).double().sum() for c in scales]
    return torch.stack(out)


def choose_scale(acceptance: dict[float, float]) -> float:
    """The scale with the highest mean acceptance; among equals the one nearest 1."""
    return max(acceptance, key=lambda c: (acceptance[c], -abs(c - 1.0)))


@torch.inference_mode()
def _teacher_forced(target, head, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits ``[M, V]`` and the head's first-draft logits ``[M, Vd]`` for the tokens
    ``ids[start:]`` (``start`` >= 2): the head reads the pairs ``(feature_j, ids[j + 1])`` as at
    drafting, and pair ``j``'s output drafts ``ids[j + 2]``, which the target predicts at ``j + 1``."""
    seq = torch.tensor([ids], dtype=torch.long, device=target.device)
    L = seq.shape[1]
    cache = target.new_cache(capacity=L + 1)
    wanted = torch.arange(start - 1, L - 1, device=target.device)
    out = target.forward(seq, cache, feature_layers=tuple(head.feature_layers), logits_for=wanted)
    # every pair j = (feature_j, ids[j + 1]) up to L - 3, causal, as the head's cache holds them at
    # drafting; pair j drafts ids[j + 2]
    hidden = head.fuse_features(out.features[:, : L - 2])
    drafted = head(seq[:, 1: L - 1], hidden)[0, start - 2:]
    return out.logits[0], head.compute_logits(drafted)


def measure_draft_temperature(target, drafter, prompts: list[str], temperatures=(0.7, 1.0), *,
                              scales=DRAFT_TEMPERATURE_SCALES, max_new_tokens: int = 64, seed: int = 0,
                              progress: bool = True) -> dict:
    """Measure the draft temperature scale of ``drafter``'s head (an EAGLE drafter) on ``prompts``
    (chat user messages), as ``training.draft_temperature`` stores it::

        {"scale", "acceptance": {scale: mean first-draft acceptance}, "temperatures", "positions",
         "prompts", "max_new_tokens"}
    """
    from .generator import SpeculativeGenerator

    head = getattr(drafter, "head", None)
    if head is None or not hasattr(head, "fuse_features") or not hasattr(head, "compute_logits"):
        raise ValueError(f"measure_draft_temperature needs an EAGLE drafter, got {type(drafter).__name__}")
    if not prompts:
        raise ValueError("measure_draft_temperature needs at least one prompt")
    temperatures = [check_real("temperature", t, 0.0, lo_open=True) for t in temperatures]
    scales = [check_real("scale", c, 0.0, lo_open=True) for c in scales]
    if not temperatures or not scales:
        raise ValueError("measure_draft_temperature needs at least one temperature and one scale")
    plain = SpeculativeGenerator(target)
    total = torch.zeros(len(scales), dtype=torch.float64)
    positions = 0
    jobs = [(t, i, p) for t in temperatures for i, p in enumerate(prompts)]
    for temperature, i, prompt in tqdm(jobs, desc="draft temperature", disable=not progress, leave=False):
        out = plain.generate(prompt=prompt, speculate=False, temperature=temperature, seed=seed + i,
                             max_new_tokens=max_new_tokens, context_overflow="truncate_prompt")
        ids = list(out.prompt_ids) + list(out.token_ids)
        start = max(len(out.prompt_ids), 2)
        if start >= len(ids):
            continue  # nothing generated (an immediate end of sequence)
        tl, dl = _teacher_forced(target, head, ids, start)
        total += acceptance_by_scale(tl, dl, head.draft_to_target, temperature, scales)
        positions += len(ids) - start
    if not positions:
        raise ValueError("measure_draft_temperature: the prompts gave no continuation to measure on")
    mean = {c: float(a) / positions for c, a in zip(scales, total)}
    return {"scale": choose_scale(mean), "acceptance": {f"{c:g}": round(a, 4) for c, a in mean.items()},
            "temperatures": temperatures, "positions": positions, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens}
