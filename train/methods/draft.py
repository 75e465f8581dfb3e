"""Draft-model distillation: a small causal LM sharing the tokenizer learns the target's
next-token distributions (forward KL, or total variation, which is exactly one minus the
expected acceptance rate of speculative sampling) on the assistant tokens."""

from __future__ import annotations

import torch

from .common import finish_metrics, forward_kl, total_variation


class DraftKDMethod(torch.nn.Module):
    def __init__(self, draft_model, target_lm_head: torch.nn.Linear, kd_loss: str = "forward_kl",
                 temperature: float = 1.0):
        super().__init__()
        if kd_loss not in ("forward_kl", "tv"):
            raise ValueError(f"kd_loss must be 'forward_kl' or 'tv', got {kd_loss!r}")
        self.draft = draft_model  # an HF causal LM (trainable)
        self.kd_loss = kd_loss
        self.temperature = temperature
        self._lm = {"head": target_lm_head}

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        # position t's logits predict token t+1: train where that token is an assistant token
        mask = (attn.bool() & batch["loss_mask"].bool())[:, 1:]
        q = self.draft(input_ids=ids, attention_mask=attn).logits[:, :-1] / self.temperature
        lm = self._lm["head"]
        with torch.no_grad():
            p = lm(batch["last_hidden"][:, :-1].to(lm.weight.dtype)).float() / self.temperature
        loss = forward_kl(q, p, mask) if self.kd_loss == "forward_kl" else total_variation(q, p, mask)
        with torch.no_grad():
            agree = ((q.argmax(-1) == p.argmax(-1)) & mask).sum() / mask.sum().clamp(min=1)
            accept = 1.0 - float(total_variation(q, p, mask))
        return loss, finish_metrics({"top1/step0": float(agree), "acceptance_estimate": accept}, [float(agree)], loss)
