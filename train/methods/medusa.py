"""Medusa-1 training (frozen backbone): head ``k`` on the target's final normed hidden state of
token ``t`` learns the target's distribution of token ``t + 2 + k`` (the target's own LM head
gives ``t + 1``), soft cross-entropy weighted ``decay**k``. :meth:`MedusaMethod.head_losses`
is also Medusa-2's heads term (there the heads read the trained backbone's states).

Reduced-vocabulary heads (``draft_vocab_size``, ``heads.draft_to_target`` set): as EAGLE-3's,
the label is the target's distribution restricted to the draft vocabulary (its logits over the
``d2t`` rows of the target's LM head, renormalised), so neither side ever materialises the full
vocabulary.

:meth:`MedusaMethod.path_counts` measures trained heads for a static tree (``speculator.choices:
fit``): per position, the rank of the target's greedy token in each head's candidates, counted
for every prefix of heads that are all right (see ``runtime.speculators.fit_medusa_choices``)."""

from __future__ import annotations

from collections import Counter

import torch

from .common import finish_metrics, soft_ce, top1


class MedusaMethod(torch.nn.Module):
    def __init__(self, heads, target_lm_head: torch.nn.Linear, position_decay: float = 0.8):
        super().__init__()
        self.heads = heads
        self.decay = position_decay
        self._lm = {"head": target_lm_head}  # frozen, not a submodule

    def head_losses(self, h: torch.Tensor, label_hidden: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Heads read ``h`` ``[B, L, H]``; labels are the target's distributions from
        ``label_hidden`` (its final normed states). Returns ``(weighted loss, metrics)``."""
        L = h.shape[1]
        logits = self.heads(h)  # [B, L, K, V]
        lm = self._lm["head"]
        w = lm.weight.detach()
        d2t = self.heads.draft_to_target
        if d2t is not None:  # the target's LM head rows of the draft vocabulary
            w = w[d2t.to(w.device)]
        total, metrics, acc = 0.0, {}, []
        for k in range(self.heads.num_heads):
            n = L - 2 - k  # tokens t whose target t+2+k exists
            if n < 1:
                break
            with torch.no_grad():
                p = torch.softmax((label_hidden[:, 1 + k : 1 + k + n].to(w.dtype) @ w.T).float(), dim=-1)
            loss_k, agree = soft_ce(logits[:, :n, k], p, valid[:, 2 + k : 2 + k + n])
            total = total + (self.decay**k) * loss_k
            metrics[f"loss/head{k}"] = float(loss_k.detach())
            metrics[f"top1/head{k}"] = float(agree)
            acc.append(float(agree))
        # head k's agreement is an unconditional rate; divided by head k-1's it approximates the
        # conditional acceptance that Leviathan's formula expects
        conditional = [acc[0]] + [acc[i] / acc[i - 1] if acc[i - 1] else 0.0 for i in range(1, len(acc))]
        return total, finish_metrics(metrics, [min(1.0, a) for a in conditional], total)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        return self.head_losses(batch["last_hidden"], batch["last_hidden"], valid)

    @torch.no_grad()
    def path_counts(self, batch: dict, ranks: int = 10) -> tuple[Counter, int]:
        """``(counts, positions)`` over the batch's positions ``t`` whose labels for every head are
        valid: ``counts[(r_0, ..., r_j)]`` is how many had head ``i``'s rank-``r_i`` candidate equal
        the target's greedy token ``t + 2 + i`` for every ``i <= j`` (ranks beyond ``ranks`` count as
        misses). The greedy token is the target's top-1 over the heads' vocabulary (the draft
        vocabulary for reduced heads: a token outside it is one no candidate can match anyway,
        apart from ties)."""
        h = batch["last_hidden"].to(next(self.heads.parameters()).dtype)
        valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
        K, L = self.heads.num_heads, h.shape[1]
        n = L - 1 - K  # positions t with t + 1 + K < L: all K labels exist
        if n < 1:
            return Counter(), 0
        w = self._lm["head"].weight.detach()
        d2t = self.heads.draft_to_target
        if d2t is not None:
            w = w[d2t.to(w.device)]
        logits = self.heads(h[:, :n])  # [B, n, K, V]
        R = min(ranks, logits.shape[-1])
        rank = torch.full((h.shape[0], n, K), R, dtype=torch.long, device=h.device)
        ok = torch.ones(h.shape[0], n, dtype=torch.bool, device=h.device)
        for k in range(K):
            label = top1(h[:, 1 + k : 1 + k + n].to(w.dtype) @ w.T)  # [B, n] (draft ids)
            hit = logits[:, :, k].topk(R, dim=-1).indices == label[..., None]  # [B, n, R]
            rank[:, :, k] = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(label, R))
            ok &= valid[:, 2 + k : 2 + k + n]
        counts: Counter = Counter()
        for row in rank[ok].tolist():
            path = ()
            for r in row:
                if r >= R:
                    break
                path += (r,)
                counts[path] += 1
        return counts, int(ok.sum())
