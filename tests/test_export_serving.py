"""Serving-format checkpoints (``specfoundry.export.serving``) and artifact identity.

Tiny random float64 Llama targets and random-init heads. Per format: export -> our reader ->
the same head function (logits over the target vocabulary) and the same speculative run as the
original head; the vLLM directory also loads in the ``speculators`` package's own loader (in
``.venv-speculators``, bootstrapped on demand by ``tools/vllm_speculators_env.py``; skipped
only when PyPI is unreachable) and reproduces our head's step through its own modules. The
HF draft directory runs in our ``draft`` drafter and in transformers' assisted generation.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specfoundry.export.identity import (
    IDENTITY_NAME,
    ArtifactError,
    ArtifactMismatchError,
    check_artifact,
    read_identity,
)
from specfoundry.export.serving import (
    SERVING_FORMATS,
    d2t_from_offsets,
    d2t_to_offsets,
    export_hf_draft,
    export_serving,
    export_sglang,
    export_trtllm,
    export_vllm,
    load_hf_draft,
    load_sglang,
    load_trtllm,
    load_vllm,
    medusa_choices,
)
from specfoundry.runtime.drafters import load_drafter
from specfoundry.runtime.drafters.draft import DraftModelDrafter, layer_subset_model
from specfoundry.runtime.drafters.eagle import Eagle3Drafter, EagleDrafter
from specfoundry.runtime.drafters.medusa import MedusaDrafter
from specfoundry.runtime.generator import SpeculativeGenerator
from specfoundry.runtime.speculators import Eagle3Head, EagleHead, MedusaHeads
from specfoundry.runtime.target import TargetModel

ROOT = Path(__file__).resolve().parent.parent
V, H, LAYERS = 64, 32, 4

pytestmark = pytest.mark.usefixtures("single_thread")


def tiny_tokenizer():
    """A word-level tokenizer over ``t0 .. t63`` (the tiny targets' vocabulary), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0")


def make_target(seed: int, layers: int = LAYERS) -> TargetModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    return TargetModel(model, tiny_tokenizer(), name=f"tiny-{seed}")


@pytest.fixture(scope="module")
def target():
    return make_target(0)


@pytest.fixture(scope="module")
def other():
    return make_target(1)


def perturbed(module, seed=1, scale=0.3):
    """Random values in every floating parameter (zero-init Medusa blocks would make a round
    trip trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return module


# a permuted, partial draft vocabulary: exercises the sort and the offset table
DRAFT_IDS = [int(i) for i in torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40]]


def make_head(kind: str, target):
    if kind == "eagle3":  # feature layers out of order: exercises the fc column permutation
        return perturbed(Eagle3Head.from_target(target, feature_layers=[3, 1, 2], draft_token_ids=DRAFT_IDS))
    if kind == "eagle3-full":
        return perturbed(Eagle3Head.from_target(target, feature_layers=[1, 2, 3], draft_vocab_size=V))
    if kind == "eagle":
        return perturbed(EagleHead.from_target(target))
    if kind == "medusa":
        return perturbed(MedusaHeads.from_target(target, num_heads=3, num_layers=2), scale=0.05)
    raise ValueError(kind)


def target_logits(head, target, seed=7, n=5):
    """The head's function on fixed random inputs, as logits over the *target* vocabulary (so a
    reordered draft vocabulary compares equal). EAGLE-3 features are fed in ascending layer
    order and permuted to the head's own order."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(head, MedusaHeads):
        return head(torch.randn(1, n, H, generator=g, dtype=torch.float64))
    layers = sorted(head.feature_layers)
    feats = torch.randn(1, n, len(layers), H, generator=g, dtype=torch.float64)
    ours = feats[:, :, [layers.index(i) for i in head.feature_layers]]
    ids = torch.randint(0, V, (1, n), generator=g)
    with torch.no_grad():
        out = head.forward(ids, head.fuse_features(ours))
        logits = head.compute_logits(out)
    full = torch.full((1, n, V), float("-inf"), dtype=logits.dtype)
    d2t = head.draft_to_target
    full[..., d2t if d2t is not None else torch.arange(V)] = logits
    return full


def assert_same_function(a, b, atol=1e-12):
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "different draft vocabularies"
    finite = ~torch.isinf(a)
    torch.testing.assert_close(a[finite], b[finite], rtol=0, atol=atol)


def drafter_for(head, target, directory=None):
    if isinstance(head, Eagle3Head):
        return Eagle3Drafter(head, depth=3, top_k=3, total_tokens=8)
    if isinstance(head, EagleHead):
        return EagleDrafter(head, depth=3, top_k=3, total_tokens=8)
    choices = medusa_choices(directory) if directory is not None else None
    return MedusaDrafter(head, choices=choices)


PROMPT = [int(i) for i in torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(11))]


def run(target, drafter, n=20):
    gen = SpeculativeGenerator(target, drafter, adaptive=False)
    return gen.generate(prompt_ids=PROMPT, max_new_tokens=n, temperature=0.0, stop_at_eos=False)


@pytest.fixture(scope="module")
def plain(target):
    return run(target, None).token_ids


ROUND_TRIPS = [
    ("vllm", "eagle3", export_vllm, load_vllm),
    ("vllm", "eagle3-full", export_vllm, load_vllm),
    ("sglang", "eagle3", export_sglang, load_sglang),
    ("sglang", "eagle", export_sglang, load_sglang),
    ("trtllm", "medusa", export_trtllm, load_trtllm),
    ("trtllm", "eagle", export_trtllm, load_trtllm),
]


@pytest.mark.parametrize("fmt,kind,writer,reader", ROUND_TRIPS, ids=[f"{f}-{k}" for f, k, _, _ in ROUND_TRIPS])
def test_round_trip_same_head_and_same_greedy_run(tmp_path, target, plain, fmt, kind, writer, reader):
    head = make_head(kind, target)
    out = tmp_path / fmt
    entry = writer(head, target, out)
    assert entry["status"] == "written", entry
    assert entry["tensors"] > 0 and entry["bytes"] == sum((out / f).stat().st_size for f in entry["files"])
    assert IDENTITY_NAME in entry["files"]
    assert read_identity(out)["speculator_type"] == head.type and read_identity(out)["artifact_format"] == fmt

    loaded = reader(out, target)
    assert type(loaded) is type(head)
    assert loaded.dtype == target.dtype
    assert_same_function(target_logits(head, target), target_logits(loaded, target))

    a = run(target, drafter_for(head, target, out if kind == "medusa" else None))
    b = run(target, drafter_for(loaded, target, out if kind == "medusa" else None))
    assert a.token_ids == b.token_ids == plain  # lossless either way ...
    # ... and the same drafts: the same number proposed and accepted at every step
    assert (a.stats.drafted, a.stats.accepted, a.stats.target_forwards) == \
        (b.stats.drafted, b.stats.accepted, b.stats.target_forwards)
    assert a.stats.drafted > 0


def test_d2t_offset_conversion():
    ours = torch.tensor([5, 2, 9, 3])
    offsets = d2t_to_offsets(ours)
    assert offsets.tolist() == [5, 1, 7, 0]  # target = draft + offset
    assert torch.equal(d2t_from_offsets(offsets), ours)


def test_vllm_file_stores_sorted_offsets_and_mask(tmp_path, target):
    head = make_head("eagle3", target)
    export_vllm(head, target, tmp_path / "v", num_speculative_tokens=4)
    t = load_file(str(tmp_path / "v" / "model.safetensors"))
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    draft = torch.arange(40)
    assert t["d2t"].dtype == torch.int64
    assert (draft + t["d2t"]).tolist() == sorted(DRAFT_IDS)  # vLLM: targets = arange + d2t
    assert t["t2d"].dtype == torch.bool and t["t2d"].nonzero().view(-1).tolist() == sorted(DRAFT_IDS)
    # lm_head row i belongs to target id sorted(DRAFT_IDS)[i]
    perm = [DRAFT_IDS.index(i) for i in sorted(DRAFT_IDS)]
    assert torch.equal(t["lm_head.weight"], head.lm_head.weight.detach()[perm])
    assert torch.equal(t["embed_tokens.weight"], target.embed_tokens.weight.detach())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == 40
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["norm_before_residual"] is False and cfg["fc_norm"] is True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["vocab_size"] == V
    # a full-size draft vocabulary has no mapping tensors (vLLM would have nowhere to load them)
    export_vllm(make_head("eagle3-full", target), target, tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "full" / "model.safetensors")))


def test_sglang_eagle3_layer_ids_use_sglang_meaning(tmp_path, target):
    """SGLang's eagle_aux_hidden_state_layer_ids name a layer's output (our index - 1); the
    EAGLE-3 default layers are left unnamed, which every reader resolves the same way."""
    export_sglang(make_head("eagle3", target), target, tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["fc_norm"] is True
    names = set(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d", "fc_norm.0.weight"} <= names
    # 7 layers: EAGLE-3's default (2, L//2, L-3) = (2, 3, 4) is left unnamed and read back as such
    t7 = make_target(5, layers=7)
    head = perturbed(Eagle3Head.from_target(t7))
    assert list(head.feature_layers) == [2, 3, 4]
    export_sglang(head, t7, tmp_path / "d")
    assert "eagle_config" not in json.loads((tmp_path / "d" / "config.json").read_text())
    loaded = load_sglang(tmp_path / "d", t7)
    assert list(loaded.feature_layers) == [2, 3, 4]
    assert_same_function(target_logits(head, t7), target_logits(loaded, t7))


def test_trtllm_medusa_layout(tmp_path, target):
    heads = make_head("medusa", target)
    export_trtllm(heads, target, tmp_path / "m", medusa_choices=[[0], [1], [0, 0], [0, 0, 0]])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architecture"] == "MedusaForCausalLM"
    assert (cfg["num_medusa_heads"], cfg["num_medusa_layers"], cfg["max_draft_len"]) == (3, 2, 4)
    assert medusa_choices(tmp_path / "m") == [[0], [1], [0, 0], [0, 0, 0]]
    t = load_file(str(tmp_path / "m" / "rank0.safetensors"))
    assert torch.equal(t["medusa_heads.1.medusa_layers.1.linear.bias"], heads.heads[1][1].linear.bias.detach())
    assert torch.equal(t["medusa_heads.2.lm_head.weight"], heads.heads[2][2].weight.detach())
    # the base model under TRT-LLM's names: fused qkv, fc = gate_proj, gate = up_proj
    layer = target.model.model.layers[1]
    assert t["transformer.layers.1.attention.qkv.weight"].shape == (32 + 16 + 16, H)
    assert torch.equal(t["transformer.layers.1.mlp.fc.weight"], layer.mlp.gate_proj.weight)
    assert torch.equal(t["transformer.layers.1.mlp.gate.weight"], layer.mlp.up_proj.weight)
    assert torch.equal(t["transformer.vocab_embedding.weight"], target.embed_tokens.weight)


SKIPS = [
    ("vllm", "eagle"), ("sglang", "medusa"), ("trtllm", "eagle3"),
    ("hf_draft", "eagle3"), ("hf_draft", "medusa"),
]


@pytest.mark.parametrize("fmt,kind", SKIPS, ids=[f"{f}-{k}" for f, k in SKIPS])
def test_unsupported_type_is_a_skipped_entry(tmp_path, target, fmt, kind):
    writer, _, types = SERVING_FORMATS[fmt]
    assert kind not in types
    entry = writer(make_head(kind, target), target, tmp_path / "out")
    assert entry["status"] == "skipped" and entry["summary"].startswith("skipped: ") and len(entry["reason"]) > 20
    assert not (tmp_path / "out").exists()


def test_draft_lm_skipped_by_head_formats(tmp_path, target):
    lm = layer_subset_model(target, [0])
    for fmt in ("vllm", "sglang", "trtllm"):
        entry = SERVING_FORMATS[fmt][0](lm, target, tmp_path / fmt)
        assert entry["status"] == "skipped" and entry["speculator_type"] == "draft", entry


def test_unrepresentable_feature_layers_skipped(tmp_path, target):
    # a 4-layer target's clamped EAGLE-3 defaults repeat a layer: no engine collects one twice
    head = Eagle3Head.from_target(target)
    assert len(set(head.feature_layers)) < len(head.feature_layers)
    for writer in (export_vllm, export_sglang):
        entry = writer(head, target, tmp_path / "x")
        assert entry["status"] == "skipped" and "repeat" in entry["reason"]
    # index L is the final normed state to us, an un-normed layer output to the engines
    top = Eagle3Head.from_target(target, feature_layers=[1, 2, LAYERS])
    entry = export_vllm(top, target, tmp_path / "y")
    assert entry["status"] == "skipped" and "normed" in entry["reason"]


def test_export_serving_reports_every_format(tmp_path, target):
    entries = export_serving(make_head("eagle", target), target, tmp_path)
    status = {e["format"]: e["status"] for e in entries}
    assert status == {"vllm": "skipped", "sglang": "written", "trtllm": "written", "hf_draft": "skipped"}
    with pytest.raises(ValueError, match="unknown serving format"):
        export_serving(make_head("eagle", target), target, tmp_path, formats=["onnx"])


def test_refuses_to_replace_a_foreign_directory(tmp_path, target):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        export_vllm(make_head("eagle3", target), target, tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    # an earlier artifact is replaced
    export_sglang(make_head("eagle", target), target, tmp_path / "a")
    entry = export_sglang(make_head("eagle", target), target, tmp_path / "a")
    assert entry["status"] == "written"


READERS = [("vllm", "eagle3"), ("sglang", "eagle"), ("trtllm", "medusa"), ("hf_draft", "draft")]


@pytest.mark.parametrize("fmt,kind", READERS, ids=[f"{f}-{k}" for f, k in READERS])
def test_mismatched_target_refused(tmp_path, target, other, fmt, kind):
    writer, reader, _ = SERVING_FORMATS[fmt]
    obj = layer_subset_model(target, [0]) if kind == "draft" else make_head(kind, target)
    out = tmp_path / fmt
    assert writer(obj, target, out)["status"] == "written"
    assert check_artifact(out, target)["target"]["fingerprint"] == target.fingerprint()
    with pytest.raises(ArtifactMismatchError) as err:
        check_artifact(out, other)
    msg = str(err.value)
    assert "'tiny-0'" in msg and "'tiny-1'" in msg and "fingerprint" in msg
    with pytest.raises(ArtifactMismatchError):
        reader(out, other)


def test_missing_identity_is_an_artifact_error(tmp_path, target):
    with pytest.raises(ArtifactError, match="missing"):
        check_artifact(tmp_path, target)


def test_head_for_another_target_is_not_exported(tmp_path, target, other):
    with pytest.raises(ValueError, match="built for target"):
        export_vllm(make_head("eagle3", target), other, tmp_path / "x")


# ---------------------------------------------------------------------------- speculators' own loader


def speculators_python() -> str:
    """``.venv-speculators``'s python, bootstrapping it on first use (a few minutes, once)."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_speculators_env.py"), "ensure"],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode == 3:
        pytest.skip(f"PyPI unreachable, cannot install speculators: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, f"bootstrapping .venv-speculators failed:\n{r.stderr[-3000:]}"
    return r.stdout.strip().splitlines()[-1]


def test_vllm_export_loads_in_speculators_package(tmp_path, target):
    py = speculators_python()
    verifier = tmp_path / "verifier"  # speculators resolves layer ids and the embedding from it
    target.model.save_pretrained(verifier)
    head = make_head("eagle3", target)
    export_vllm(head, target, tmp_path / "spec", verifier=verifier, num_speculative_tokens=5)

    # one EAGLE-3 step on fixed inputs, features in ascending layer order (what engines feed)
    g = torch.Generator().manual_seed(7)
    layers = sorted(head.feature_layers)
    feats = torch.randn(1, 5, 3, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (1, 5), generator=g)
    save_file({"features": feats, "input_ids": ids}, str(tmp_path / "probe.safetensors"))
    r = subprocess.run([py, str(ROOT / "tools" / "vllm_speculators_load.py"), str(tmp_path / "spec"),
                        str(tmp_path / "out"), str(tmp_path / "probe.safetensors")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["class"] == "Eagle3DraftModel" and summary["use_draft_vocab"] is True
    assert summary["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and summary["fc_norm"] is True
    assert summary["num_speculative_tokens"] == 5 and summary["verifier"] == str(verifier)

    # every tensor we wrote is what speculators holds after loading
    ours = load_file(str(tmp_path / "spec" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "out" / "state.safetensors"))
    for name, value in ours.items():
        assert torch.equal(theirs[name].to(value.dtype), value), name
    assert set(theirs) - set(ours) <= {"verifier_lm_head.weight", "verifier_norm.weight"}

    # and its modules compute our head's step
    with torch.no_grad():
        out = head.forward(ids, head.fuse_features(feats[:, :, [layers.index(i) for i in head.feature_layers]]))
        logits = head.compute_logits(out)
    full = torch.full((1, 5, V), float("-inf"), dtype=torch.float64)
    full[..., head.d2t] = logits
    step = load_file(str(tmp_path / "out" / "logits.safetensors"))
    torch.testing.assert_close(step["hidden"], out, rtol=0, atol=1e-12)
    assert_same_function(step["logits"], full)


# ---------------------------------------------------------------------------- HF draft directories


def test_hf_draft_loads_in_draft_drafter_and_assisted_generation(tmp_path, target, plain):
    lm = layer_subset_model(target, [0, 3])
    entry = export_hf_draft(lm, target, tmp_path / "draft")
    assert entry["status"] == "written"
    assert {"config.json", "model.safetensors", "tokenizer.json", IDENTITY_NAME} <= set(entry["files"])

    # our runtime: the directory is a `draft` drafter, lossless and with the exported weights
    drafter = load_drafter(str(tmp_path / "draft"), target, dtype=torch.float64)
    assert isinstance(drafter, DraftModelDrafter)
    sd, ref = drafter.lm.model.state_dict(), lm.model.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    out = run(target, drafter)
    assert out.token_ids == plain and out.stats.accepted > 0
    assert load_hf_draft(tmp_path / "draft", target).tokenizer.get_vocab() == target.tokenizer.get_vocab()

    # transformers' assisted generation with the directory as the assistant model
    assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float64)
    x = torch.tensor([PROMPT])
    greedy = target.model.generate(x, do_sample=False, max_new_tokens=20)
    assisted = target.model.generate(x, do_sample=False, max_new_tokens=20, assistant_model=assistant)
    assert assisted.tolist() == greedy.tolist()
    assert greedy[0, len(PROMPT):].tolist() == plain


def test_hf_draft_refuses_another_vocabulary(tmp_path, target):
    cfg = LlamaConfig(vocab_size=V + 8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="vocabulary"):
        export_hf_draft(LlamaForCausalLM(cfg), target, tmp_path / "x")


def test_partial_reexport_keeps_the_other_formats_in_the_report(tmp_path):
    import json

    from specfoundry.export.cli import _merged_with_previous

    base = {"speculator": "s", "speculator_type": "eagle3", "target": {"fingerprint": "f"}, "trained": True}
    first = {**base, "written": {"vllm": {"path": "v"}, "onnx": {"path": "o"}}, "skipped": {"trtllm": "no layout"},
             "parity": {"onnx": {"max": 1e-4}}}
    f = tmp_path / "export_report.json"
    f.write_text(json.dumps(first))
    again = {**base, "written": {"ptx": {"path": "p"}}, "skipped": {"trt_engines": "no tensorrt"}, "parity": {}}
    merged = _merged_with_previous(again, f)
    assert set(merged["written"]) == {"vllm", "onnx", "ptx"} and set(merged["skipped"]) == {"trtllm", "trt_engines"}
    assert merged["parity"] == {"onnx": {"max": 1e-4}}
    redo = {**base, "written": {}, "skipped": {"onnx": "failed"}, "parity": {}}  # a format redone replaces its entry
    merged = _merged_with_previous(redo, f)
    assert "onnx" not in merged["written"] and merged["skipped"]["onnx"] == "failed" and "onnx" not in merged["parity"]
    other = {**base, "target": {"fingerprint": "g"}, "written": {"ptx": {}}, "skipped": {}, "parity": {}}
    assert _merged_with_previous(other, f)["written"] == {"ptx": {}}  # another target: nothing kept
