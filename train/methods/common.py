"""Loss pieces every method shares: masked soft cross-entropy against the target distribution,
top-1 agreement, and the predicted tau from per-position agreement."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specfoundry.runtime.adaptive import expected_tokens


def soft_ce(q_logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over ``mask`` of ``-sum p log softmax(q)``, and the top-1 agreement rate (no grad)."""
    denom = mask.sum().clamp(min=1)
    ce = -(p * F.log_softmax(q_logits.float(), dim=-1)).sum(-1)
    loss = (ce * mask).sum() / denom
    with torch.no_grad():
        agree = ((q_logits.argmax(-1) == p.argmax(-1)) & mask).sum() / denom
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
