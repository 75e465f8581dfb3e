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
