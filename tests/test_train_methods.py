"""Every training method lowers its loss on a tiny random target, and what it trains loads in
the runtime and stays lossless (greedy output equals the target's)."""

import pytest
import torch

from tiny_models import tiny_llama
from specfoundry.runtime import SpeculativeGenerator, load_drafter
from specfoundry.runtime.drafters.draft import DraftModelDrafter, layer_subset_model
from specfoundry.runtime.speculators import EagleHead, Eagle3Head, MedusaHeads, save_speculator
from specfoundry.train.methods import DraftKDMethod, Eagle1Method, Eagle3Method, Medusa2Method, MedusaMethod

pytestmark = pytest.mark.usefixtures("single_thread")


def _batch(target, layers, B=4, L=16, seed=0):
    # target-generated continuations, like self-distilled data (random ids would be unlearnable)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (B, 3), generator=g)
    with torch.no_grad():
        ids = target.model.generate(ids, max_new_tokens=L - 3, do_sample=True, top_k=8,
                                    attention_mask=torch.ones_like(ids), pad_token_id=0)
        hs = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids, dtype=torch.bool),
            "features": torch.stack([hs[j] for j in layers], 2), "last_hidden": hs[-1]}


def _fit(method, batch, steps=40, lr=3e-3):
    opt = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=lr)
    losses = []
    method.train()
    for _ in range(steps):
        loss, metrics = method(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses
    assert metrics["predicted_tau"] >= 1.0
    return metrics


def _lossless(target, drafter, **opts):
    gen = SpeculativeGenerator(target, drafter, adaptive=False, **opts)
    for prompt in ([1, 2, 3, 4], [9, 8, 7]):
        spec = gen.generate(prompt_ids=prompt, max_new_tokens=20)
        plain = gen.generate(prompt_ids=prompt, max_new_tokens=20, speculate=False)
        assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa1"])
def test_head_methods_train_and_stay_lossless(kind, tmp_path):
    target = tiny_llama(0, dtype=torch.float32)
    if kind == "eagle3":
        head = Eagle3Head.from_target(target, draft_vocab_size=48)
        method = Eagle3Method(head, target.lm_head, ttt_steps=2)
    elif kind == "eagle":
        head = EagleHead.from_target(target)
        method = Eagle1Method(head)
    else:
        head = MedusaHeads.from_target(target, num_heads=3)
        method = MedusaMethod(head, target.lm_head)
    _fit(method, _batch(target, head.feature_layers))
    save_speculator(head, tmp_path / "spec", target)
    drafter = load_drafter(str(tmp_path / "spec"), target=target)
    _lossless(target, drafter)


@pytest.mark.parametrize("kd_loss", ["forward_kl", "tv"])
def test_draft_distillation_trains_and_stays_lossless(kd_loss, tmp_path):
    target = tiny_llama(0, dtype=torch.float32)
    draft = layer_subset_model(target, [0, 3])
    for p in draft.model.parameters():
        p.requires_grad_(True)
    method = DraftKDMethod(draft.model.train(), target.lm_head, kd_loss=kd_loss)
    _fit(method, _batch(target, [target.num_layers]), steps=30, lr=1e-3)
    draft.model.eval().save_pretrained(tmp_path / "draft")
    _lossless(target, load_drafter(str(tmp_path / "draft"), target=target), max_depth=3)


def test_medusa2_warms_up_the_heads_then_trains_the_lora_jointly(tmp_path):
    from types import SimpleNamespace

    from specfoundry.train.methods.medusa2 import lora_backbone, merged_backbone

    target = tiny_llama(0, dtype=torch.float32)
    heads = MedusaHeads.from_target(target, num_heads=2)
    backbone = lora_backbone(target, SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in backbone.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    method = Medusa2Method(backbone, heads, target.lm_head, heads_warmup_steps=3)
    batch = _batch(target, heads.feature_layers)
    lora = lambda: [p.detach().clone() for n, p in backbone.named_parameters() if "lora_B" in n]
    opt = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=3e-3)
    before = lora()
    for step in range(3):  # warm-up: the heads alone (LoRA B starts at zero and stays there)
        loss, m = method(batch)
        assert m["warmup"] == 1.0 and "loss/lm_kl" not in m
        opt.zero_grad(); loss.backward(); opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, lora()))
    first = None
    for step in range(30):
        loss, m = method(batch)
        assert m["warmup"] == 0.0 and m["loss/lm_kl"] >= 0
        first = first if first is not None else loss.item()
        opt.zero_grad(); loss.backward(); opt.step()
    assert loss.item() < 0.75 * first
    assert any(not torch.equal(a, b) for a, b in zip(before, lora()))
    assert int(method.step) == 33 and "step" in dict(method.named_buffers())
    # the merged backbone is a plain causal LM whose output matches the LoRA model's
    merged = merged_backbone(backbone).eval()
    backbone.eval()
    with torch.no_grad():
        ids = batch["input_ids"][:1]
        diff = (merged(input_ids=ids).logits - backbone(input_ids=ids).logits).abs().max().item()
        assert diff < 1e-4, diff


def test_draft_from_config_or_pretrained_dir_trains_and_stays_lossless(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from specfoundry.train.methods.draft import draft_model_for
    from specfoundry.train.recipe import DraftArchConfig

    target = tiny_llama(0, dtype=torch.float32)
    spec = SimpleNamespace(layers=None, init_from=None,
                           config=DraftArchConfig(hidden_size=target.hidden_size, num_layers=1, num_attention_heads=2))
    lm = draft_model_for(spec, target)
    assert lm.num_layers == 1 and lm.vocab_size == target.vocab_size
    assert torch.equal(lm.embed_tokens.weight, target.embed_tokens.weight.float())  # same width: copied
    _fit(DraftKDMethod(lm.model, target.lm_head), _batch(target, [target.num_layers]), steps=30, lr=1e-3)
    lm.model.eval().save_pretrained(tmp_path / "draft")
    _lossless(target, load_drafter(str(tmp_path / "draft"), target=target), max_depth=3)

    # init_from: the saved draft dir as a pretrained start; a different vocabulary is refused
    again = draft_model_for(SimpleNamespace(layers=None, config=None, init_from=str(tmp_path / "draft")), target)
    assert all(torch.equal(a, b) for a, b in zip(again.model.state_dict().values(), lm.model.state_dict().values()))
    other = tiny_llama(0, vocab=80)
    other.model.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary"):
        draft_model_for(SimpleNamespace(layers=None, config=None, init_from=str(tmp_path / "other")), target)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # CI has no hub: the name must fail fast and clearly
    with pytest.raises(ValueError, match="init_from"):
        draft_model_for(SimpleNamespace(layers=None, config=None, init_from="no/such-model-here"), target)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_head_layer_warm_start_from_a_target_layer(kind):
    from specfoundry.train.run import init_layer_from_target

    target = tiny_llama(0, dtype=torch.float32)
    head = (Eagle3Head if kind == "eagle3" else EagleHead).from_target(target)
    before = head.layer.self_attn.q_proj.weight.detach().clone()
    copied = init_layer_from_target(head, target, 2)
    src = target.model.model.layers[2]
    assert torch.equal(head.layer.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert "mlp.gate_proj.weight" in copied and "self_attn.o_proj.weight" in copied
    H = target.hidden_size
    q = head.layer.self_attn.q_proj.weight
    if kind == "eagle3":  # 2H inputs: the hidden half is the target's, the embedding half untouched
        assert torch.equal(q[:, H:], src.self_attn.q_proj.weight) and torch.equal(q[:, :H], before[:, :H])
        assert torch.equal(head.layer.hidden_norm.weight, src.input_layernorm.weight)
    else:
        assert torch.equal(q, src.self_attn.q_proj.weight)
