"""EAGLE-1 training: feature regression + token cross-entropy.

Pairs ``(f_t, x_{t+1})`` (``f`` = the target's final normed hidden state) run causally through
the head, which predicts ``f_{t+1}``; the loss is SmoothL1 to the real ``f_{t+1}`` plus
``ce_weight`` x soft cross-entropy of ``lm_head(f_pred)`` against the target's distribution of
token ``t+2``. Uniform feature noise (EAGLE-1's augmentation) makes the head robust to its own
imperfect features while drafting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import finish_metrics, soft_ce


class Eagle1Method(torch.nn.Module):
    def __init__(self, head, ce_weight: float = 0.1, noise: float = 0.1):
        super().__init__()
        self.head = head
        self.ce_weight = ce_weight
        self.noise = noise

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        ids = batch["input_ids"]
        feats = batch["features"][:, :, 0]  # [B, L, H] (feature_layers == (L,))
        valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        f_in = feats[:, :-1]
        if self.training and self.noise:
            f_in = f_in + (torch.rand_like(f_in) - 0.5) * 2 * self.noise * f_in.abs().mean()
        pred = self.head(ids[:, 1:], f_in)  # [B, L-1, H]: predicted f_{t+1}
        n = pred.shape[1] - 1
        reg_mask = valid[:, 1 : 1 + n]
        reg = F.smooth_l1_loss(pred[:, :n], feats[:, 1 : 1 + n].to(pred.dtype), reduction="none").mean(-1)
        reg = (reg * reg_mask).sum() / reg_mask.sum().clamp(min=1)
        with torch.no_grad():
            p = torch.softmax(self.head.compute_logits(feats[:, 1 : 1 + n]).float(), dim=-1)
        ce, agree = soft_ce(self.head.compute_logits(pred[:, :n]), p, valid[:, 2 : 2 + n])
        total = reg + self.ce_weight * ce
        return total, finish_metrics({"loss/regression": float(reg.detach()), "loss/ce": float(ce.detach()),
                                      "top1/step0": float(agree)}, [float(agree)], total)
