"""Loss pieces every method shares: masked soft cross-entropy against the target distribution,
top-1 agreement, and the predicted tau from per-position agreement."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specfoundry.runtime.adaptive import expected_tokens


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is narrower (bfloat16 logits under autocast); float64 stays."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def top1(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the index of the first maximum (ties and NaN as ``argmax``), taken from
    ``max``'s indices, whose CPU kernel is ~2-4x faster than ``argmax``'s over a vocabulary."""
    return x.max(-1).indices


def soft_ce(q_logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor,
            p_top1: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over ``mask`` of ``-sum p log softmax(q)``, and the top-1 agreement rate (no grad).

    ``p_top1``: ``p``'s top-1 (:func:`top1`) when the caller already has it."""
    denom = mask.sum().clamp(min=1)
    q = at_least_float32(q_logits)
    ce = -(p * F.log_softmax(q, dim=-1)).sum(-1)
    loss = (ce * mask).sum() / denom
    with torch.no_grad():
        # the float copy has the bfloat16 logits' order exactly, and max is cheaper over float32
        agree = ((top1(q) == (top1(p) if p_top1 is None else p_top1)) & mask).sum() / denom
    return loss, agree


def forward_kl(q_logits: torch.Tensor, p_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over ``mask`` of KL(p || q) (distillation toward the target)."""
    logp = F.log_softmax(p_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - F.log_softmax(q_logits.float(), dim=-1))).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def total_variation(q_logits: torch.Tensor, p_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over ``mask`` of TV(p, q) = 1 - (expected acceptance of q under p's verifier)."""
    tv = 0.5 * (torch.softmax(p_logits.float(), -1) - torch.softmax(q_logits.float(), -1)).abs().sum(-1)
    return (tv * mask).sum() / mask.sum().clamp(min=1)


def finish_metrics(metrics: dict, agreements: list[float], total: torch.Tensor) -> dict:
    """Add the loss and the tau predicted from per-position agreement (Leviathan et al.)."""
    metrics["predicted_tau"] = expected_tokens(agreements, len(agreements)) if agreements else 1.0
    metrics["loss"] = float(total.detach()) if torch.is_tensor(total) else float(total)
    return metrics
