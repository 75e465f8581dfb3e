"""ONNX export: both attention variants, parity with PyTorch, end-to-end greedy decoding in onnxruntime.

Tiny float32 Llama (vocab 16 so random-init speculators get some drafts accepted, which
exercises the KV commit of accepted tree paths), exported once per module. Checks: the bit-packed
mask format, the TreeAttention contract in its three forms (torch reference vs SDPA, ONNX
reference function vs torch reference in onnxruntime), graph structure per variant, parity at
several dynamic shapes, and greedy speculative decoding with target and speculator in
onnxruntime giving the PyTorch runtime's tokens (divergences must be reported near-ties).
The real SmolLM2 export is in the ``slow`` tier.
"""

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from specfoundry.export.onnx import (
    NEAR_TIE,
    OrtEagleHead,
    OrtMedusaHeads,
    OrtTarget,
    compare_greedy,
    export_all,
    export_onnx,
    graph_paths,
    greedy_end_to_end,
    parity_report,
    pack_tree_mask,
    read_metadata,
    tree_attention_function_proto,
    tree_attention_reference,
    tree_mask_words,
    unpack_tree_mask,
)
from specfoundry.runtime.speculators import Eagle3Head, EagleHead, MedusaHeads
from specfoundry.runtime.tree import ancestor_matrix
from tiny_models import tiny_llama

ort = pytest.importorskip("onnxruntime")

TREE_SIZES = (1, 4, 9, 40)  # 40 > 32: two mask words per row
PAST_LENGTHS = (0, 3, 17)
EAGLE_OPTIONS = dict(depth=3, top_k=4, total_tokens=40)  # trees of up to 37 nodes (W = 2)


@pytest.fixture(scope="module")
def tiny(single_thread):
    return tiny_llama(1, vocab=16, hidden=32, layers=2, dtype=torch.float32)


@pytest.fixture(scope="module")
def eagle3(tiny):
    return Eagle3Head.from_target(tiny, seed=1)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 16, (n,), generator=gen).tolist() for n in (5, 12)]


@pytest.fixture(scope="module")
def exported(tiny, eagle3, prompts, tmp_path_factory):
    """Both graphs in both variants, with parity and end-to-end figures (the export report entry)."""
    out = tmp_path_factory.mktemp("onnx")
    return export_all(tiny, eagle3, out, prompts=prompts, max_new_tokens=24, drafter_options=EAGLE_OPTIONS,
                      tree_sizes=TREE_SIZES, past_lengths=PAST_LENGTHS)


def _random_tree_mask(B, T, gen):
    parents = torch.full((B, T), -1, dtype=torch.long)
    for i in range(1, T):
        parents[:, i] = (torch.rand(B, generator=gen) * i).long()
    return ancestor_matrix(parents)


# --------------------------------------------------------------------------- mask format


def test_pack_unpack_round_trip_and_bit_layout():
    gen = torch.Generator().manual_seed(0)
    for T in (1, 5, 31, 32, 33, 64, 70):
        m = torch.rand(3, T, T, generator=gen) > 0.5
        packed = pack_tree_mask(m)
        assert packed.dtype == torch.int32 and packed.shape == (3, T, tree_mask_words(T))
        assert torch.equal(unpack_tree_mask(packed), m)
    # bit t % 32 of word t // 32; bit 31 is the sign bit
    m = torch.zeros(1, 40, 40, dtype=torch.bool)
    m[0, 0, 0] = m[0, 1, 31] = m[0, 2, 32] = m[0, 3, 33] = True
    p = pack_tree_mask(m)
    assert p[0, 0].tolist() == [1, 0] and p[0, 1].tolist() == [-(2**31), 0]
    assert p[0, 2].tolist() == [0, 1] and p[0, 3].tolist() == [0, 2]
    assert pack_tree_mask(torch.ones(1, 32, 32, dtype=torch.bool))[0, 0, 0] == -1
    # every int32 word pattern survives unpack -> pack
    words = torch.randint(-(2**31), 2**31 - 1, (2, 64, 2), generator=gen, dtype=torch.int64).to(torch.int32)
    assert torch.equal(pack_tree_mask(unpack_tree_mask(words)), words)
    with pytest.raises(ValueError, match="words"):
        unpack_tree_mask(words, 10)


# --------------------------------------------------------------------------- the op contract


def _case(B, Hq, Hkv, T, P, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, P + T, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, P + T, D, generator=gen).to(dtype)
    tree = _random_tree_mask(B, T, gen)
    return q, k, v, tree


@pytest.mark.parametrize("T,P", [(1, 0), (4, 3), (9, 17), (40, 5)])
def test_reference_matches_sdpa_with_gqa(T, P):
    q, k, v, tree = _case(2, 4, 2, T, P, 8, seed=T + P)
    allowed = torch.cat([torch.ones(2, T, P, dtype=torch.bool), tree], -1)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    got = tree_attention_reference(q, k, v, pack_tree_mask(tree), 0.3)
    assert (got - want).abs().max() < 1e-5
    # the registered custom op is the same reference
    assert torch.equal(torch.ops.specfoundry.tree_attention(q, k, v, pack_tree_mask(tree), 0.3), got)


def _one_node_model(dtype):
    """A graph with one specfoundry::TreeAttention node plus the reference function."""
    et = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}[dtype]
    node = helper.make_node("TreeAttention", ["q", "k", "v", "m"], ["out"], domain="specfoundry", scale=0.3,
                            plugin_namespace="specfoundry", plugin_version="1")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("q", et, ["B", 4, "T", 8]),
                                            helper.make_tensor_value_info("k", et, ["B", 2, "S", 8]),
                                            helper.make_tensor_value_info("v", et, ["B", 2, "S", 8]),
                                            helper.make_tensor_value_info("m", TensorProto.INT32, ["B", "T", "W"])],
                              [helper.make_tensor_value_info("out", et, ["B", 4, "T", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("specfoundry", 1)],
                              functions=[tree_attention_function_proto(23)])
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_reference_function_runs_in_onnxruntime(dtype, tol):
    sess = ort.InferenceSession(_one_node_model(dtype).SerializeToString(), providers=["CPUExecutionProvider"])
    for T, P in [(1, 0), (4, 3), (9, 17), (40, 5)]:
        q, k, v, tree = _case(2, 4, 2, T, P, 8, dtype, seed=T * 31 + P)
        m = pack_tree_mask(tree)
        (out,) = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "m": m.numpy()})
        want = tree_attention_reference(q, k, v, m, 0.3)
        assert out.dtype == want.numpy().dtype
        assert np.abs(out.astype(np.float32) - want.float().numpy()).max() < tol, (T, P)


# --------------------------------------------------------------------------- graph structure


def test_plugin_graphs_carry_the_custom_node_and_its_function(exported, tiny):
    for name in ("target", "speculator"):
        path = graph_paths(exported["out_dir"], "plugin")[name]
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
        nodes = [n for n in model.graph.node if n.domain == "specfoundry"]
        assert len(nodes) == (tiny.num_layers if name == "target" else 1)
        assert not [n for n in model.graph.node if n.op_type == "Attention"]
        for n in nodes:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            assert n.op_type == "TreeAttention"
            assert attrs["plugin_namespace"] == b"specfoundry" and attrs["plugin_version"] == b"1"
            assert attrs["scale"] == pytest.approx(8 ** -0.5)
        (fn,) = [f for f in model.functions if (f.domain, f.name) == ("specfoundry", "TreeAttention")]
        assert {"scale", "plugin_namespace", "plugin_version"} <= set(fn.attribute)
        opsets = {o.domain: o.version for o in model.opset_import}
        assert opsets["specfoundry"] == 1 and opsets[""] == 23
        mask = next(i for i in model.graph.input if i.name == "tree_mask")
        assert mask.type.tensor_type.elem_type == TensorProto.INT32
        assert [d.dim_param for d in mask.type.tensor_type.shape.dim] == ["batch", "new_tokens", "mask_words"]
        # the reference function is what onnxruntime runs: without it the graph does not load
        del model.functions[:]
        with pytest.raises(Exception, match="TreeAttention"):
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_standard_graphs_use_opset23_attention(exported, tiny):
    for name in ("target", "speculator"):
        model = onnx.load(str(graph_paths(exported["out_dir"], "standard")[name]))
        onnx.checker.check_model(model)
        assert {o.domain: o.version for o in model.opset_import}[""] == 23
        attn = [n for n in model.graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
        assert len(attn) == (tiny.num_layers if name == "target" else 1)
        assert not [n for n in model.graph.node if n.domain == "specfoundry"] and not model.functions
        mask = next(i for i in model.graph.input if i.name == "tree_mask")
        assert mask.type.tensor_type.elem_type == TensorProto.BOOL


def test_graph_interface_and_metadata(exported, tiny, eagle3):
    g = exported["graphs"]["plugin"]
    t, s = g["target"], g["speculator"]
    L = tiny.num_layers
    assert list(t["inputs"])[:3] == ["input_ids", "position_ids", "tree_mask"]
    assert t["inputs"]["past_key_values.1.value"] == ["batch", 2, "past", 8]
    assert t["outputs"]["present.1.key"] == ["batch", 2, "past + new_tokens", 8]
    assert t["outputs"]["hidden_states"] == ["batch", "new_tokens", len(eagle3.feature_layers), 32]
    assert len(t["outputs"]) == 2 + 2 * L
    assert list(s["outputs"]) == ["hidden_out", "logits", "present.0.key", "present.0.value"]
    assert s["fuse"]["inputs"]["features"] == ["batch", "new_tokens", len(eagle3.feature_layers), 32]
    meta = read_metadata(t["path"])
    assert meta["feature_layers"] == list(eagle3.feature_layers) and meta["variant"] == "plugin"
    assert meta["target"]["fingerprint"] == tiny.fingerprint()


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("variant", ["standard", "plugin"])
def test_parity_at_dynamic_shapes(exported, variant):
    par = exported["parity"][variant]
    shapes = {(r["tree_size"], r["past_len"]) for r in par["target"]["shapes"]}
    assert shapes == {(T, P) for T in TREE_SIZES for P in PAST_LENGTHS}
    for r in par["target"]["shapes"]:
        # relative to the magnitude (fp32: ~1e-6 relative seen)
        assert r["logits"] <= 1e-5 * max(1.0, r["logits_scale"]), r
        assert r["hidden_states"] <= 1e-5 * max(1.0, r["hidden_scale"]), r
        assert r["kv"] < 1e-4 and r["wrapper_logits"] <= 1e-5 * max(1.0, r["logits_scale"]), r
    for r in par["speculator"]["shapes"]:
        assert max(r["hidden"], r["logits"], r["kv"], r["fuse"]) < 1e-4, r
    assert any(r["tree_size"] == "2-level partial past" for r in par["speculator"]["shapes"])


def test_dynamic_batch_one_token_no_past(exported, tiny):
    """B=1, T=1, P=0 (none of them the traced sizes) through the raw session."""
    for variant in ("standard", "plugin"):
        target = OrtTarget(graph_paths(exported["out_dir"], variant)["target"])
        out = target.forward(torch.tensor([[3]]), target.new_cache())
        ref = tiny.forward(torch.tensor([[3]]), tiny.new_cache())
        assert out.logits.shape == (1, 1, 16) and (out.logits - ref.logits).abs().max() < 1e-4


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("variant", ["standard", "plugin"])
def test_eagle3_greedy_end_to_end_in_onnxruntime(exported, variant):
    e2e = exported["end_to_end"][variant]
    for r in e2e["prompts"]:
        for key in ("ort_vs_torch", "ort_vs_plain", "torch_vs_plain"):
            c = r[key]
            # any divergence must be an explicitly reported near-tie, never silent
            assert c["equal"] or c["near_tie"], (key, c)
    assert e2e["unexplained"] == 0
    # drafts were accepted, so accepted-path KV commits went through the ORT caches too
    assert max(r["tau_ort"] for r in e2e["prompts"]) > 1.0
    assert [r["tau_ort"] for r in e2e["prompts"]] == [r["tau_torch"] for r in e2e["prompts"]]


def test_medusa_export_external_data_and_end_to_end(exported, tiny, prompts, tmp_path):
    heads = MedusaHeads.from_target(tiny, seed=1)
    with torch.no_grad():  # non-zero residual blocks so the graph is not just lm_head
        for h in heads.heads:
            h[0].linear.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "speculator.standard.onnx"
    rep = export_onnx(heads, path, "standard", external_data=True)
    assert rep["external_data"] and (tmp_path / "speculator.standard.onnx.data").exists()
    assert rep["op_counts"].get("Attention", 0) == 0
    x = torch.randn(2, 3, 32)
    assert (OrtMedusaHeads(path)(x) - heads(x)).abs().max() < 1e-4
    assert OrtMedusaHeads(path).tree_choices() == heads.tree_choices()  # the default tree
    # a checkpoint's own tree (e.g. fitted by training) travels with the graph
    heads.drafter_options = {"choices": [[0], [1], [0, 0]]}
    export_onnx(heads, tmp_path / "fitted.onnx", "standard")
    assert OrtMedusaHeads(tmp_path / "fitted.onnx").tree_choices() == [[0], [1], [0, 0]]
    # the target graph from the EAGLE-3 export outputs layer L (what Medusa reads) too
    e2e = greedy_end_to_end(tiny, heads, graph_paths(exported["out_dir"], "plugin")["target"], path, prompts,
                            max_new_tokens=24)
    assert e2e["unexplained"] == 0 and all(r["ort_vs_torch"]["equal"] or r["ort_vs_torch"]["near_tie"]
                                           for r in e2e["prompts"])
    assert max(r["tau_ort"] for r in e2e["prompts"]) > 1.0


def test_eagle1_head_plugin_export(exported, tiny, prompts, tmp_path):
    head = EagleHead.from_target(tiny, seed=2)
    rep = export_onnx(head, tmp_path / "speculator.plugin.onnx", "plugin")
    assert rep["op_counts"]["specfoundry::TreeAttention"] == 1 and Path(rep["fuse"]["path"]).exists()
    shutil.copy(graph_paths(exported["out_dir"], "plugin")["target"], tmp_path / "target.plugin.onnx")
    par = parity_report(tiny, head, tmp_path, variants=("plugin",), tree_sizes=(4, 40), past_lengths=(0, 17))
    assert max(par["plugin"]["speculator"]["max"].values()) < 1e-4, par["plugin"]["speculator"]["max"]
    e2e = greedy_end_to_end(tiny, head, tmp_path / "target.plugin.onnx", tmp_path / "speculator.plugin.onnx",
                            prompts, max_new_tokens=16, drafter_options=EAGLE_OPTIONS)
    assert e2e["unexplained"] == 0


def test_divergences_are_reported_with_the_top2_gap(tiny):
    prompt = [1, 2, 3]
    ref = [int(tiny.forward(torch.tensor([prompt]), tiny.new_cache()).logits[0, -1].argmax())]
    same = compare_greedy(tiny, prompt, ref, list(ref))
    assert same == {"equal": True, "first_divergence": None, "top2_gap": None, "near_tie": False}
    other = compare_greedy(tiny, prompt, ref + [5], ref + [6])
    assert other["first_divergence"] == 1 and not other["equal"]
    # the last position's logits alone, as the report computes them (a one-row LM-head product: with the
    # ATen kernels an fp32 one-row product and a four-row one differ in the last bits)
    logits = tiny.forward(torch.tensor([prompt + ref]), tiny.new_cache(),
                          logits_for=torch.tensor([len(prompt)])).logits[0, -1].double()
    top = logits.topk(2).values
    assert other["top2_gap"] == pytest.approx(float(top[0] - top[1]))
    assert other["near_tie"] == (other["top2_gap"] < NEAR_TIE)
    # an exact tie: copy the argmax row of the LM head into another token's row (not in the context)
    tied = tiny_llama(1, vocab=16, hidden=32, layers=2, dtype=torch.float32)
    ctx = prompt + ref
    logits = tied.forward(torch.tensor([ctx]), tied.new_cache()).logits[0, -1]
    a = int(logits.argmax())
    b = next(i for i in range(16) if i != a and i not in ctx)
    with torch.no_grad():
        tied.lm_head.weight[b] = tied.lm_head.weight[a]
    res = compare_greedy(tied, prompt, ref + [a], ref + [b])
    assert res["first_divergence"] == 1 and res["top2_gap"] == 0.0 and res["near_tie"]
    # a length mismatch is a divergence at the shorter length
    assert compare_greedy(tiny, prompt, ref, [])["first_divergence"] == 0


def test_export_and_wrappers_refuse_bad_requests(exported, tiny, tmp_path):
    with pytest.raises(ValueError, match="variant"):
        export_onnx(tiny, tmp_path / "x.onnx", "tensorrt")
    with pytest.raises(ValueError, match="float64"):
        export_onnx(tiny_llama(0, vocab=16, hidden=32, layers=1), tmp_path / "x.onnx")
    with pytest.raises(TypeError, match="cannot export"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    paths = graph_paths(exported["out_dir"], "standard")
    with pytest.raises(ValueError, match="not a target"):
        OrtTarget(paths["speculator"])
    with pytest.raises(ValueError, match="not an EAGLE"):
        OrtEagleHead(paths["target"])
    target = OrtTarget(paths["target"])
    with pytest.raises(ValueError, match="not exported"):
        target.forward(torch.tensor([[1]]), target.new_cache(), feature_layers=(1, 2, 0, 99))


# --------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.slow
def test_smollm2_plugin_export_runs_in_onnxruntime(smollm2, tmp_path):
    head = Eagle3Head.from_target(smollm2, seed=0, draft_vocab_size=64)
    path = tmp_path / "target.plugin.onnx"
    rep = export_onnx(smollm2, path, "plugin", feature_layers=head.feature_layers)
    assert rep["op_counts"]["specfoundry::TreeAttention"] == smollm2.num_layers
    target = OrtTarget.like(path, smollm2, threads=2)
    ids = torch.tensor([smollm2.encode_chat([{"role": "user", "content": "Name a colour."}])])
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])[None]
    c_ort, c_pt = target.new_cache(), smollm2.new_cache()
    for model, cache in ((target, c_ort), (smollm2, c_pt)):
        model.forward(ids, cache)
        cache.commit()
    P = ids.shape[1]
    pos = torch.tensor([[P, P + 1, P + 1]])
    got = target.forward(torch.tensor([[1, 2, 3]]), c_ort, position_ids=pos, tree_mask=tree,
                         feature_layers=head.feature_layers)
    want = smollm2.forward(torch.tensor([[1, 2, 3]]), c_pt, position_ids=pos, tree_mask=tree,
                           feature_layers=head.feature_layers)
    assert (got.logits - want.logits).abs().max() <= 1e-4 * want.logits.abs().max()
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))


def test_engine_profiles_resolve_every_plugin_graph_input(exported):
    """The TensorRT builder's profile shapes cover every input of the three plugin graphs
    (target, EAGLE step, EAGLE fusion) from their exported dim names alone."""
    from specfoundry.export.trt import engine

    onnx_dir = Path(exported["out_dir"])
    prof = engine._normalise_profiles({"batch": (1, 1, 2), "tree_tokens": (1, 8, 32), "past": (0, 16, 64)})[0]
    for name in engine.MODELS.values():
        dims = engine.onnx_input_dims(onnx_dir / name)
        shapes = engine.profile_shapes(dims, prof)
        assert set(shapes) == set(dims)
        for lo, opt, hi in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    fuse = engine.profile_shapes(engine.onnx_input_dims(onnx_dir / engine.MODELS["speculator_fuse"]), prof)
    (lo, opt, hi), = fuse.values()
    assert lo[:2] == (1, 1) and opt[:2] == (1, 8) and hi[:2] == (2, 32)  # batch, tree tokens
