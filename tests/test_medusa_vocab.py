"""Medusa heads over a reduced draft vocabulary (issue 13, item 4): the heads' LM heads cover
``draft_vocab_size`` target tokens listed by ``d2t``; drafts are mapped to target ids, a sampled
draft's ``q`` is a distribution over the whole target vocabulary (zero outside the draft
vocabulary), speculative decoding stays lossless, the map round-trips through the checkpoint
and is validated on load, ONNX carries it and TensorRT-LLM (no map) refuses it in one line.
The sampling distribution test for these heads is in test_sampling_lossless.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import tiny_llama
from specfoundry.runtime import SpeculativeGenerator
from specfoundry.runtime.drafters.base import DraftContext
from specfoundry.runtime.drafters.medusa import MedusaDrafter
from specfoundry.runtime.sampling import SamplingParams
from specfoundry.runtime.speculators import CheckpointError, MedusaHeads, load_speculator, save_speculator

pytestmark = pytest.mark.usefixtures("single_thread")

V = 64
VOCAB = [60, 3, 17, 41, 5, 8, 22, 33, 1, 2, 50, 12]  # a permuted subset: draft id i <-> VOCAB[i]
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7, 9, 10, 11, 7, 7], [42]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _perturbed(heads, seed=4, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return heads


def reduced(target, **arch):
    return MedusaHeads.from_target(target, num_heads=3, draft_token_ids=VOCAB, **arch)


def test_reduced_heads_start_from_the_targets_rows_and_keep_the_full_ones_available(target):
    heads = reduced(target)
    assert heads.draft_vocab_size == len(VOCAB) and heads.architecture["draft_vocab_size"] == len(VOCAB)
    assert heads.draft_to_target.tolist() == VOCAB and heads.t2d.sum() == len(VOCAB) and bool(heads.t2d[60])
    w = target.lm_head.weight.detach()
    assert torch.equal(heads.heads[1][-1].weight, w[VOCAB])
    x = torch.randn(2, 32, dtype=torch.float64)
    assert heads(x).shape == (2, 3, len(VOCAB))
    full = MedusaHeads.from_target(target, num_heads=3)  # Medusa's original heads: no map, no new key
    assert full.draft_to_target is None and "draft_vocab_size" not in full.architecture
    assert full(x).shape == (2, 3, V) and "d2t" not in full.state_dict()
    with pytest.raises(ValueError, match="draft_vocab_size: must be in \\[1, vocab_size=64\\]"):
        MedusaHeads.from_target(target, draft_vocab_size=65)


def test_greedy_drafts_are_target_ids_of_the_head_ranks(target):
    heads = _perturbed(reduced(target))
    choices = [[0], [1], [0, 0], [0, 2], [1, 0], [0, 0, 1]]
    drafter = MedusaDrafter(heads, choices=choices)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    feats = target.forward(prompt[:, :-1], target.new_cache(), feature_layers=drafter.feature_layers).features
    drafter.begin(prompt, feats)
    draft = drafter.propose(DraftContext(prompt, SamplingParams(0.0), 3, 10))
    with torch.inference_mode():
        ranked = heads(feats[:, -1, 0])[0].argsort(-1, descending=True)  # [K, Vd] draft ids
    for i, path in enumerate(drafter.paths, start=1):
        assert int(draft.tokens[0, i]) == VOCAB[int(ranked[len(path) - 1, path[-1]])]
    with pytest.raises(ValueError, match="rank beyond the heads' vocabulary of 12 tokens"):
        MedusaDrafter(heads, choices=[[0], [12]])


def test_sampled_q_is_a_distribution_over_target_ids_zero_outside_the_draft_vocab(target):
    heads = _perturbed(reduced(target))
    drafter = MedusaDrafter(heads)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    feats = target.forward(prompt[:, :-1], target.new_cache(), feature_layers=drafter.feature_layers).features
    drafter.begin(prompt, feats)
    ctx = DraftContext(prompt, SamplingParams(1.0), 3, 10, generator=torch.Generator().manual_seed(0))
    draft = drafter.propose(ctx)
    q = draft.q[0, 1:]
    assert q.shape[-1] == V
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[0], dtype=q.dtype))
    outside = torch.ones(V, dtype=torch.bool)
    outside[VOCAB] = False
    assert float(q[:, outside].abs().max()) == 0.0
    # every drafted token is a target id of the draft vocabulary, drawn where its q is positive
    toks = draft.tokens[0, 1:]
    assert set(toks.tolist()) <= set(VOCAB)
    assert bool((q.gather(1, toks.view(-1, 1)) > 0).all())


@pytest.mark.parametrize("opts", [{}, {"max_depth": 2, "max_nodes": 4}])
def test_reduced_vocab_medusa_is_greedy_exact(target, opts):
    gen = SpeculativeGenerator(target, MedusaDrafter(_perturbed(reduced(target), scale=0.02)), adaptive=False, **opts)
    drafted = 0
    for prompt in PROMPTS:
        spec = gen.generate(prompt_ids=prompt, max_new_tokens=30)
        plain = gen.generate(prompt_ids=prompt, max_new_tokens=30, speculate=False)
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats.drafted
    assert drafted > 0


def test_checkpoint_roundtrip_keeps_the_map(tmp_path, target):
    heads = _perturbed(reduced(target))
    path = save_speculator(heads, tmp_path / "m", target)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architecture"]["draft_vocab_size"] == len(VOCAB)
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["d2t"].tolist() == VOCAB and tensors["d2t"].dtype == torch.int64
    loaded = load_speculator(path, target)
    assert loaded.draft_to_target.tolist() == VOCAB
    x = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(loaded(x), heads(x))


def _edit(path, name, fn):
    f = path / "model.safetensors"
    t = load_file(str(f))
    t[name] = fn(t[name].clone())
    save_file(t, str(f), metadata={"format": "pt"})


def _at(i, v):
    def fn(x):
        x.view(-1)[i] = v
        return x
    return fn


@pytest.mark.parametrize("name,fn,match", [
    ("d2t", _at(0, 64), r"key 'd2t': token ids must lie in \[0, vocab_size=64\); found 1..64"),
    ("d2t", _at(0, -1), r"key 'd2t': token ids must lie in \[0, vocab_size=64\)"),
    ("d2t", _at(0, 3), r"key 'd2t': draft token ids must be distinct"),
    ("d2t", lambda x: x.double(), r"key 'd2t': (must hold integer token ids|dtype torch.float64 does not fit)"),
    ("t2d", _at(0, True), r"key 't2d': does not mark exactly the target ids listed in d2t"),
    ("heads.0.1.weight", _at(3, float("nan")), r"key 'heads.0.1.weight': holds 1 non-finite value"),
])
def test_a_corrupt_map_or_weight_is_refused_at_load(tmp_path, target, name, fn, match):
    path = save_speculator(reduced(target), tmp_path / "m", target)
    _edit(path, name, fn)
    with pytest.raises(CheckpointError, match=match):
        load_speculator(path, target)


def test_a_missing_map_is_refused_and_an_old_full_vocab_checkpoint_loads(tmp_path, target):
    path = save_speculator(reduced(target), tmp_path / "m", target)
    f = path / "model.safetensors"
    t = load_file(str(f))
    del t["d2t"]
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="key 'd2t': missing tensor"):
        load_speculator(path, target)
    old = save_speculator(MedusaHeads.from_target(target, num_heads=2), tmp_path / "old", target)
    assert "draft_vocab_size" not in json.loads((old / "config.json").read_text())["architecture"]
    assert load_speculator(old, target).draft_to_target is None


def test_trtllm_refuses_reduced_vocab_heads_in_one_line(tmp_path, target):
    from specfoundry.export.serving import export_trtllm

    rep = export_trtllm(reduced(target), target, tmp_path / "t")
    assert rep["status"] == "skipped" and "no draft-vocabulary map" in rep["reason"] and "\n" not in rep["reason"]
    assert not (tmp_path / "t").exists()
    full = export_trtllm(MedusaHeads.from_target(target, num_heads=2), target, tmp_path / "f")
    assert full["status"] != "skipped"


def test_onnx_export_carries_the_map(tmp_path):
    pytest.importorskip("onnxruntime")
    from specfoundry.export.onnx import OrtMedusaHeads, export_onnx

    tiny = tiny_llama(0, dtype=torch.float32)
    heads = _perturbed(MedusaHeads.from_target(tiny, num_heads=3, draft_token_ids=VOCAB))
    path = tmp_path / "medusa.onnx"
    export_onnx(heads, path, "standard")
    ort_heads = OrtMedusaHeads(path)
    assert ort_heads.draft_to_target.tolist() == VOCAB
    x = torch.randn(2, 32)
    assert (ort_heads(x) - heads(x)).abs().max() < 1e-4
    # the ONNX heads behind the runtime's drafter propose the same target ids as the torch heads
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    feats = tiny.forward(prompt[:, :-1], tiny.new_cache(), feature_layers=(tiny.num_layers,)).features
    drafts = []
    for h in (heads, ort_heads):
        d = MedusaDrafter(h)
        d.begin(prompt, feats)
        drafts.append(d.propose(DraftContext(prompt, SamplingParams(0.0), 3, 10)).tokens)
    assert torch.equal(drafts[0], drafts[1]) and set(drafts[0][0, 1:].tolist()) <= set(VOCAB)


def test_training_labels_are_the_target_distribution_restricted_to_the_draft_vocab(target):
    from specfoundry.train.methods import MedusaMethod

    heads = reduced(target).float()
    t32 = tiny_llama(0, dtype=torch.float32)
    method = MedusaMethod(heads, t32.lm_head)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 7, 32, generator=g)
    batch = {"last_hidden": h, "attention_mask": torch.ones(2, 7), "loss_mask": torch.ones(2, 7)}
    loss, metrics = method(batch)
    # head 0 on token t learns the target's distribution of t+2 over the draft vocabulary
    w = t32.lm_head.weight.detach()[VOCAB]
    p = torch.softmax(h[:, 1:6] @ w.T, -1)
    q = torch.log_softmax(heads(h)[:, :5, 0].float(), -1).detach()
    assert abs(metrics["loss/head0"] - float(-(p * q).sum(-1).mean())) < 1e-5
    loss.backward()
    assert heads.heads[0][-1].weight.grad is not None and heads.heads[0][-1].weight.grad.shape == (len(VOCAB), 32)


@pytest.mark.parametrize("vocab", [None, VOCAB], ids=["full", "reduced"])
def test_vllm_medusa_layout_round_trip_carries_the_token_map(tmp_path, target, vocab):
    from specfoundry.export.serving import export_vllm, load_vllm

    heads = _perturbed(MedusaHeads.from_target(target, num_heads=3, num_layers=2, draft_token_ids=vocab))
    entry = export_vllm(heads, target, tmp_path / "v")
    assert entry["status"] == "written", entry
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (3, 2, True)
    t = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert cfg["truncated_vocab_size"] == (len(VOCAB) if vocab else V)
    assert t["lm_heads.2.weight"].shape == (cfg["truncated_vocab_size"], 32)
    assert torch.equal(t["blocks.1.layers.1.bias"], heads.heads[1][1].linear.bias.detach())
    assert ("token_map" in t) == (vocab is not None)
    if vocab:
        assert t["token_map"].tolist() == VOCAB and t["token_map"].dtype == torch.int64
    loaded = load_vllm(tmp_path / "v", target)
    assert isinstance(loaded, MedusaHeads) and loaded.draft_vocab_size == heads.draft_vocab_size
    x = torch.randn(2, 32, dtype=torch.float64)
    assert torch.equal(loaded(x), heads(x))
    gen_a = SpeculativeGenerator(target, MedusaDrafter(heads), adaptive=False)
    gen_b = SpeculativeGenerator(target, MedusaDrafter(loaded), adaptive=False)
    a, b = (g.generate(prompt_ids=PROMPTS[0], max_new_tokens=20) for g in (gen_a, gen_b))
    assert a.token_ids == b.token_ids and (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)


def test_vllm_medusa_bad_token_map_is_refused(tmp_path, target):
    from specfoundry.export.identity import ArtifactError
    from specfoundry.export.serving import export_vllm, load_vllm

    export_vllm(reduced(target), target, tmp_path / "v")
    f = tmp_path / "v" / "model.safetensors"
    t = load_file(str(f))
    t["token_map"][0] = V
    save_file(t, str(f))
    with pytest.raises(ArtifactError, match="d2t: token ids must lie in"):
        load_vllm(tmp_path / "v", target)
    del t["token_map"]
    save_file(t, str(f))
    with pytest.raises(ArtifactError, match="no token_map tensor"):
        load_vllm(tmp_path / "v", target)
