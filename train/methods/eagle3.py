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
import torch.nn.functional as F

from .common import at_least_float32, finish_metrics, soft_ce, top1


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
        """Head outputs per TTT step: ``outs[j]`` ``[B, L-1-j, H]`` (start ``s`` at index ``s``).

        Each step runs the head's decoder layer by hand (:meth:`_layer_step`, what the drafter
        runs) with the attention computed as blocks instead of one dense masked product: step 0
        is causal attention over its ``L-1`` entries; step ``j >= 1`` row ``s`` scores step 0's
        keys ``t <= s`` (one causal product) and, of every later step ``i <= j`` (itself
        included), only its own entry ``s`` (a diagonal: an elementwise product), all under one
        softmax. Step ``i`` has ``L-1-i`` entries; step ``j`` uses the first ``L-1-j`` of each.
        """
        B, L = input_ids.shape
        head = self.head
        dev = head.device
        a = head.architecture
        hkv = a["num_key_value_heads"]
        g = a["num_attention_heads"] // hkv
        scale = head.layer.self_attn.scaling
        hidden = head.fuse_features(features[:, :-1])
        keys, values = [], []  # per step: [B, hkv, n_i, D]
        future = torch.ones(L - 1, L - 1, dtype=torch.bool, device=dev).triu(1)  # t > s: hidden
        outs = []
        for j in range(self.ttt_steps):
            n = L - 1 - j
            if n < 1:
                break

            def attention(q, k, v, j=j, n=n):
                D = q.shape[-1]
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, hkv, n, D]
                keys.append(k)
                values.append(v)
                if j == 0:
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=scale,
                                                       enable_gqa=g > 1)  # [B, hq, n, D]
                    return o.transpose(1, 2).reshape(B, n, -1)
                # query head h reads KV head h // g: [B, hkv, g, n, D]
                qg = (q * scale).reshape(B, n, hkv, g, D).permute(0, 2, 3, 1, 4)
                k0, v0 = keys[0][:, :, :n], values[0][:, :, :n]
                causal = (qg.reshape(B, hkv, g * n, D) @ k0.transpose(-1, -2)).view(B, hkv, g, n, n)
                diag = torch.stack([torch.linalg.vecdot(qg, kk[:, :, None, :n]) for kk in keys[1:]], dim=-1)
                hide = torch.cat([future[:n, :n], future.new_zeros(n, j)], dim=1)
                # one softmax over [step 0's t <= s | steps 1..j's entry s]; in bfloat16 (under
                # autocast) it accumulates in float32, and its probabilities meet V in bfloat16,
                # as in the fused attention kernels
                scores = torch.cat([causal, diag.to(causal.dtype)], dim=-1).masked_fill_(hide, float("-inf"))
                pc, pd = torch.softmax(scores, dim=-1).split([n, j], dim=-1)
                o = (pc.reshape(B, hkv, g * n, n) @ v0).view(B, hkv, g, n, D)
                for i, vv in enumerate(values[1:]):
                    o = o + pd[..., i : i + 1] * vv[:, :, None, :n]
                return o.permute(0, 3, 1, 2, 4).reshape(B, n, -1).to(v.dtype)

            ids = input_ids[:, 1 + j :]
            h_in = hidden if j == 0 else outs[-1][:, :n]
            pos = (torch.arange(n, device=dev) + j).expand(B, n)
            outs.append(head._layer_step(ids, h_in, pos, attention))
        return outs

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        input_ids = batch["input_ids"]
        valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        outs = self.unroll(input_ids, batch["features"])
        L = input_ids.shape[1]
        with torch.no_grad():
            # step j's start s predicts token s+2+j, whose target distribution is the LM head's
            # over last_hidden[s+1+j]: step j's rows are rows 1+j..L-2, a suffix of step 0's,
            # so one product, softmax and top-1 over rows 1..L-2 serve every step (sliced)
            p_all = torch.softmax(at_least_float32(self.target_logits(batch["last_hidden"][:, 1 : L - 1])), dim=-1)
            top_all = top1(p_all)
        total = 0.0
        metrics = {}
        acc = []
        for j, out in enumerate(outs):
            n = out.shape[1] - 1  # starts s whose predicted token s+2+j exists
            if n < 1:
                break
            q_logits = self.head.compute_logits(out[:, :n])  # soft_ce takes it to float32
            mask = valid[:, 2 + j : 2 + j + n]
            step_loss, agree = soft_ce(q_logits, p_all[:, j : j + n], mask, top_all[:, j : j + n])
            total = total + (self.decay**j) * step_loss
            metrics[f"loss/step{j}"] = float(step_loss.detach())
            metrics[f"top1/step{j}"] = float(agree)
            acc.append(float(agree))
        # TTT step j feeds the head its own outputs, so its agreement approximates the
        # conditional acceptance at draft depth j+1
        finish_metrics(metrics, acc, total)
        return total, metrics
