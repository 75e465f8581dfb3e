"""EAGLE-3 training: training-time test (TTT) unroll with soft cross-entropy against the target.

A batch holds token ids, the target's features at the head's feature layers and the target's
final normed hidden state (``last_hidden``, whose ``lm_head`` gives the target distribution).

Step 0 runs the pairs ``(fuse(f_s), x_{s+1})`` at positions ``s`` causally. Step ``j >= 1``
feeds each start ``s`` its own step ``j-1`` output with the true next token, at position ``s+j``,
attending to the real-feature entries ``t <= s`` and to its own earlier steps only — exactly
what the runtime drafter computes when it drafts ``j`` tokens after committed token ``s+1``
(a test checks this equality). Step ``j``'s output for start ``s`` predicts token ``s+2+j``;
its loss is the soft cross-entropy against the target distribution restricted to the draft
vocabulary, weighted ``decay**j``.
"""

from __future__ import annotations

import torch

from specfoundry.runtime.target import KVCache

from .common import finish_metrics, soft_ce


class Eagle3Method(torch.nn.Module):
    """``forward(batch) -> (loss, metrics)``; an ``nn.Module`` so Accelerate/DeepSpeed can wrap
    the whole loss (the head is its only trainable submodule)."""

    def __init__(self, head, target_lm_head: torch.nn.Linear, ttt_steps: int = 3, position_decay: float = 0.8):
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        self.head = head
        self.ttt_steps = ttt_steps
        self.decay = position_decay
        # the target's frozen LM head: a plain attribute, so it is neither trained nor saved
        self._lm_weight = {"w": target_lm_head.weight}

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Target logits over the draft vocabulary for ``last_hidden`` ``[..., H]``."""
        w = self._lm_weight["w"].detach()
        d2t = self.head.draft_to_target
        w = w[d2t.to(w.device)] if d2t is not None else w
        return last_hidden.to(w.dtype) @ w.T

    def unroll(self, input_ids: torch.Tensor, features: torch.Tensor) -> list[torch.Tensor]:
        """Head outputs per TTT step: ``outs[j]`` ``[B, L-1-j, H]`` (start ``s`` at index ``s``)."""
        B, L = input_ids.shape
        dev = self.head.device
        cache = KVCache()
        hidden = self.head.fuse_features(features[:, :-1])
        outs = []
        sizes = []  # entries each earlier step put in the cache
        for j in range(self.ttt_steps):
            n = L - 1 - j
            if n < 1:
                break
            ids = input_ids[:, 1 + j :]
            s = torch.arange(n, device=dev)
            if j == 0:
                allowed = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
                h_in = hidden
            else:
                blocks = [torch.arange(sizes[0], device=dev)[None, :] <= s[:, None]]  # real features t <= s
                for size in sizes[1:]:
                    blocks.append(torch.arange(size, device=dev)[None, :] == s[:, None])  # own earlier steps
                blocks.append(torch.eye(n, dtype=torch.bool, device=dev))  # itself
                allowed = torch.cat(blocks, dim=1)
                h_in = outs[-1][:, :n]
            pos = (s + j).expand(B, n)
            out = self.head(ids, h_in, position_ids=pos, attention_mask=allowed.expand(B, *allowed.shape), cache=cache)
            cache.commit()
            outs.append(out)
            sizes.append(n)
        return outs

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        input_ids = batch["input_ids"]
        valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        outs = self.unroll(input_ids, batch["features"])
        total = 0.0
        metrics = {}
        acc = []
        for j, out in enumerate(outs):
            n = out.shape[1] - 1  # starts s whose predicted token s+2+j exists
            if n < 1:
                break
            q_logits = self.head.compute_logits(out[:, :n]).float()
            with torch.no_grad():
                p = torch.softmax(self.target_logits(batch["last_hidden"][:, 1 + j : 1 + j + n]).float(), dim=-1)
            mask = valid[:, 2 + j : 2 + j + n]
            step_loss, agree = soft_ce(q_logits, p, mask)
            total = total + (self.decay**j) * step_loss
            metrics[f"loss/step{j}"] = float(step_loss.detach())
            metrics[f"top1/step{j}"] = float(agree)
            acc.append(float(agree))
        # TTT step j feeds the head its own outputs, so its agreement approximates the
        # conditional acceptance at draft depth j+1
        finish_metrics(metrics, acc, total)
        return total, metrics
