"""Medusa-2 training (Cai et al. 2024): the heads and a LoRA on the backbone train jointly.

``loss = KL(p_target || p_backbone) + heads_loss_weight * sum_k decay**k CE_k``: the first term
is Medusa-2's self-distillation, which keeps the fine-tuned backbone's next-token distribution
on the original target's (labels from the frozen target's final states, ``batch["last_hidden"]``);
the heads read the *backbone's* final states, so the backbone learns states the heads can use.
For the first ``heads_warmup_steps`` only the heads train (backbone states detached, no KL),
as in the paper's warm-up.

The fine-tuned backbone is a new target: ``merged_backbone`` gives it with the LoRA folded in,
and the heads are saved for that model (``train/run.py`` writes it next to the speculator).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .medusa import MedusaMethod


def lora_backbone(target, lora) -> torch.nn.Module:
    """A float32 copy of the target's causal LM with peft LoRA adapters (only they train)."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(target.model).float()
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                     target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def merged_backbone(peft_model) -> torch.nn.Module:
    """The plain causal LM with the LoRA weights merged in (a copy; ``peft_model`` is kept)."""
    return copy.deepcopy(peft_model).merge_and_unload()


class Medusa2Method(torch.nn.Module):
    def __init__(self, backbone, heads, target_lm_head: torch.nn.Linear, *, position_decay: float = 0.8,
                 heads_loss_weight: float = 0.2, heads_warmup_steps: int = 0):
        super().__init__()
        self.backbone = backbone  # peft model: only the LoRA parameters require grad
        self.medusa = MedusaMethod(heads, target_lm_head, position_decay)
        self.heads = heads
        self.heads_loss_weight = heads_loss_weight
        self.heads_warmup_steps = heads_warmup_steps
        self._lm = {"head": target_lm_head}  # frozen, not a submodule
        # a buffer, so the warm-up position is saved in checkpoints and restored on resume
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def backbone_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The backbone's final normed hidden states ``[B, L, H]`` (LoRA applied)."""
        inner = self.backbone.get_base_model().model  # LoRA layers are injected in place
        return inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        warm = int(self.step) < self.heads_warmup_steps
        if self.training:
            self.step += 1
        valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        if warm:
            with torch.no_grad():
                h = self.backbone_states(batch["input_ids"], batch["attention_mask"])
            total, metrics = self.medusa.head_losses(h, batch["last_hidden"], valid)
            metrics["warmup"] = 1.0
            return total, metrics
        h = self.backbone_states(batch["input_ids"], batch["attention_mask"])
        heads_loss, metrics = self.medusa.head_losses(h, batch["last_hidden"], valid)
        # self-distillation on the positions with loss: KL(target || backbone) over the full vocabulary
        lm = self._lm["head"]
        sel = valid.view(-1)
        q = lm(h.reshape(-1, h.shape[-1])[sel].to(lm.weight.dtype)).float()
        with torch.no_grad():
            p_logits = lm(batch["last_hidden"].reshape(-1, h.shape[-1])[sel].to(lm.weight.dtype)).float()
        kl = F.kl_div(F.log_softmax(q, -1), F.log_softmax(p_logits, -1), log_target=True, reduction="batchmean")
        total = kl + self.heads_loss_weight * heads_loss
        metrics["loss/lm_kl"] = float(kl.detach())
        metrics["loss"] = float(total.detach())
        metrics["warmup"] = 0.0
        return total, metrics
