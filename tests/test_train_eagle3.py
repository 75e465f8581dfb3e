"""EAGLE-3 training: the TTT unroll computes exactly what the runtime drafter computes."""

import torch

from tiny_models import tiny_llama
from specfoundry.runtime.speculators import Eagle3Head
from specfoundry.runtime.target import KVCache
from specfoundry.train.methods.eagle3 import Eagle3Method

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")


def _batch(target, head, B=2, L=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, L), generator=g)
    out = target.model.model(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    feats = torch.stack([hs[i] for i in head.feature_layers], dim=2)
    return {"input_ids": ids, "attention_mask": torch.ones(B, L, dtype=torch.long),
            "loss_mask": torch.ones(B, L, dtype=torch.bool), "features": feats, "last_hidden": hs[-1]}


def test_ttt_unroll_equals_runtime_drafting():
    target = tiny_llama(0)
    head = Eagle3Head.from_target(target).to(torch.float64)
    method = Eagle3Method(head, target.lm_head, ttt_steps=3)
    batch = _batch(target, head)
    with torch.no_grad():
        outs = method.unroll(batch["input_ids"], batch["features"])
        for s in (0, 4, 7):
            ids, feats = batch["input_ids"][:1], batch["features"][:1]
            cache = KVCache()
            g = head(ids[:, 1 : s + 2], head.fuse_features(feats[:, : s + 1]), cache=cache)
            cache.commit()
            h = g[:, -1:]
            torch.testing.assert_close(h[0, 0], outs[0][0, s], rtol=0, atol=1e-10)
            for j in (1, 2):
                allowed = torch.ones(1, 1, cache.length + 1, dtype=torch.bool)
                h = head(ids[:, s + 1 + j : s + 2 + j], h, position_ids=torch.tensor([[s + j]]), attention_mask=allowed,
                         cache=cache)
                cache.commit()
                torch.testing.assert_close(h[0, 0], outs[j][0, s], rtol=0, atol=1e-10)


def _unroll_dense(method, input_ids, features):
    """The TTT unroll as one dense masked attention per step: the head's HF forward over a
    growing KV cache, step ``j`` seeing step 0's entries ``t <= s`` and entry ``s`` of every
    later step (itself included): the reference :meth:`Eagle3Method.unroll` must equal."""
    head = method.head
    B, L = input_ids.shape
    cache = KVCache()
    hidden = head.fuse_features(features[:, :-1])
    outs, sizes = [], []
    for j in range(method.ttt_steps):
        n = L - 1 - j
        if n < 1:
            break
        s = torch.arange(n)
        if j == 0:
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            h_in = hidden
        else:
            blocks = [torch.arange(sizes[0])[None, :] <= s[:, None]]
            blocks += [torch.arange(size)[None, :] == s[:, None] for size in sizes[1:]]
            allowed = torch.cat(blocks + [torch.eye(n, dtype=torch.bool)], dim=1)
            h_in = outs[-1][:, :n]
        out = head(input_ids[:, 1 + j :], h_in, position_ids=(s + j).expand(B, n),
                   attention_mask=allowed.expand(B, *allowed.shape), cache=cache)
        cache.commit()
        outs.append(out)
        sizes.append(n)
    return outs


@pytest.mark.parametrize("ttt_steps", [1, 2, 3, 4])
def test_ttt_unroll_equals_dense_masked_attention(ttt_steps):
    """The block (causal + diagonals) attention of the unroll equals the dense masked attention
    over all steps' entries, outputs and the head's gradients, with grouped-query attention."""
    target = tiny_llama(0)
    head = Eagle3Head.from_target(target).to(torch.float64)
    a = head.architecture
    assert a["num_attention_heads"] != a["num_key_value_heads"]  # GQA
    method = Eagle3Method(head, target.lm_head, ttt_steps=ttt_steps)
    batch = _batch(target, head, B=2, L=9, seed=1)
    grads = []
    for unroll in (method.unroll, lambda i, f: _unroll_dense(method, i, f)):
        head.zero_grad()
        outs = unroll(batch["input_ids"], batch["features"])
        assert [o.shape[1] for o in outs] == [8 - j for j in range(ttt_steps)]
        # a loss on every output, with weights that differ per entry
        w = [torch.randn(o.shape, generator=torch.Generator().manual_seed(3 + j), dtype=o.dtype)
             for j, o in enumerate(outs)]
        sum((o * wj).sum() for o, wj in zip(outs, w)).backward()
        got = {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}
        grads.append(([o.detach() for o in outs], got))
    (new_outs, new_grads), (ref_outs, ref_grads) = grads
    for o, r in zip(new_outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-10)
    assert new_grads.keys() == ref_grads.keys() and "layer.self_attn.k_proj.weight" in ref_grads
    for k in ref_grads:
        torch.testing.assert_close(new_grads[k], ref_grads[k], rtol=1e-9, atol=1e-10, msg=k)


def _forward_per_step(method, batch):
    """The EAGLE-3 loss written per TTT step: step ``j``'s target distribution from its own rows
    ``last_hidden[:, 1+j : 1+j+n]`` and top-1 agreement by ``argmax`` (what :meth:`Eagle3Method.forward`
    computes once over rows ``1..L-2`` and slices)."""
    valid = batch["attention_mask"].bool() & batch["loss_mask"].bool()
    total, metrics = 0.0, {}
    for j, out in enumerate(method.unroll(batch["input_ids"], batch["features"])):
        n = out.shape[1] - 1
        q = method.head.compute_logits(out[:, :n])
        with torch.no_grad():
            p = torch.softmax(method.target_logits(batch["last_hidden"][:, 1 + j : 1 + j + n]), dim=-1)
        mask = valid[:, 2 + j : 2 + j + n]
        ce = -(p * torch.log_softmax(q, dim=-1)).sum(-1)
        loss = (ce * mask).sum() / mask.sum()
        total = total + method.decay**j * loss
        metrics[f"loss/step{j}"] = float(loss)
        metrics[f"top1/step{j}"] = float(((q.argmax(-1) == p.argmax(-1)) & mask).sum() / mask.sum())
    return total, metrics


def test_forward_shares_the_target_distribution_across_steps():
    """One target softmax and top-1 over all rows, sliced per step, give every step's loss,
    agreement and the head's gradients of the per-step computation (float64, a reduced draft
    vocabulary, a masked prompt)."""
    target = tiny_llama(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=40).to(torch.float64)
    method = Eagle3Method(head, target.lm_head, ttt_steps=3)
    batch = _batch(target, head, B=3, L=14, seed=2)
    batch["loss_mask"][:, :4] = False
    batch["loss_mask"][1, 9] = False
    results = []
    for fwd in (method, lambda b: _forward_per_step(method, b)):
        head.zero_grad()
        loss, metrics = fwd(batch)
        loss.backward()
        results.append((float(loss), metrics, {k: p.grad.clone() for k, p in head.named_parameters()
                                               if p.grad is not None}))
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = results
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for j in range(3):
        assert metrics[f"loss/step{j}"] == pytest.approx(ref_metrics[f"loss/step{j}"], rel=1e-12)
        assert metrics[f"top1/step{j}"] == ref_metrics[f"top1/step{j}"]
    assert 0 < sum(metrics[f"top1/step{j}"] for j in range(3)) < 3  # agreement neither none nor all
    assert grads.keys() == ref_grads.keys() and "lm_head.weight" in grads
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-10, atol=1e-12, msg=k)


def test_top1_is_argmax():
    """:func:`top1` (``max``'s indices) is ``argmax``: the first of tied maxima, NaN as the
    maximum, rows of ``-inf``, bfloat16, a non-contiguous slice."""
    from specfoundry.train.methods.common import top1

    g = torch.Generator().manual_seed(0)
    for V, hi in ((2048, 3), (37, 2), (64, 50)):
        x = torch.randint(0, hi, (4, 9, V), generator=g).double()  # many ties
        x[0, 1, 5] = float("nan")
        x[1, 2] = float("-inf")
        for t in (x, x[:, 2:], x.bfloat16(), x.float()[1:, ::2]):
            assert torch.equal(top1(t), t.argmax(-1))
