"""Tree-attention kernel, AOT PTX, TensorRT plugin ABI, engine builder and GPU check (export/trt).

The Triton kernel runs under TRITON_INTERPRET=1 in ONE subprocess per session (the variable must be
set before triton is imported, and other test modules in this process import triton normally);
parametrized tests then assert on its per-case records. AOT compilation needs no GPU. TensorRT
tests skip with a reason where tensorrt does not import or no CUDA device is visible.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specfoundry.export.trt import aot, engine, plugin
from specfoundry.export.trt import kernel as K

INTERP_DTYPES = ("float32", "float16")  # the interpreter has no bf16 arithmetic: bf16 is GPU-only

_INTERP_SCRIPT = textwrap.dedent(r"""
    import json, sys, time, torch
    torch.set_num_threads(1)
    from specfoundry.export.trt import kernel as K, plugin
    rec = {"cases": {}, "extra": {}}
    t0 = time.perf_counter()
    for name in K.CASES:
        for dt in (torch.float32, torch.float16):
            r = K.run_case(name, dt, seed=1)
            rec["cases"][f"{name}-{r['dtype']}"] = r
    # the mask must matter: hide one visible non-self token from one row
    q, k, v, m, scale = K.make_case(1, 2, 1, 40, 5, 16, torch.float32, seed=2)
    tree = K.unpack_tree_mask(m, 40)
    row = 39
    col = int(torch.nonzero(tree[0, row, :row])[0])
    tree2 = tree.clone(); tree2[0, row, col] = False
    m2 = K.pack_tree_mask(tree2)
    got = K.tree_attention(q, k, v, m2, scale)
    rec["extra"]["mutated_vs_mutated_ref"] = (got - K.reference_tree_attention(q, k, v, m2, scale)).abs().max().item()
    rec["extra"]["mutated_vs_original_ref"] = (got - K.reference_tree_attention(q, k, v, m, scale)).abs().max().item()
    # launch with exactly the plugin's argument list and grid (what TensorRT will pass), on the interpreter
    q, k, v, m, scale = K.make_case(2, 4, 2, 33, 21, 32, torch.float32, seed=3)
    out = torch.full_like(q, float("nan"))
    args = plugin.kernel_launch_args(tuple(q.shape), tuple(k.shape))
    ios = {("input", 0): q, ("input", 1): k, ("input", 2): v, ("input", 3): m, ("output", 0): out}
    values = [ios[a.source] if a.kind == "ptr" else int(a.value) for a in args]
    dims = plugin.launch_dims(tuple(q.shape))
    K.tree_attention_kernel[dims["grid"]](*values, **K.constexprs(scale, 32, torch.float32))
    rec["extra"]["plugin_args_launch"] = (out - K.reference_tree_attention(q, k, v, m, scale)).abs().max().item()
    rec["seconds"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(rec))
""")


@pytest.fixture(scope="session")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("case", list(K.CASES))
def test_kernel_matches_reference_interpreted(interpreted, case, dtype):
    r = interpreted["cases"][f"{case}-{dtype}"]
    assert r["finite"], r
    assert r["max_abs_err"] <= r["tol"], r


def test_kernel_honours_the_tree_mask(interpreted):
    extra = interpreted["extra"]
    assert extra["mutated_vs_mutated_ref"] <= 1e-4
    assert extra["mutated_vs_original_ref"] > 1e-2  # so hiding one token changes the answer


def test_kernel_runs_with_the_plugins_launch_args(interpreted):
    assert interpreted["extra"]["plugin_args_launch"] <= 1e-4


# ---------------------------------------------------------------------------------------------
# reference and mask packing (no Triton launches)

def test_reference_matches_sdpa_with_a_bool_mask():
    q, k, v, m, scale = K.make_case(2, 6, 2, 37, 9, 16, torch.float64, seed=4)
    tree = K.unpack_tree_mask(m, 37)
    allowed = torch.cat([torch.ones(2, 37, 9, dtype=torch.bool), tree], dim=-1)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=allowed, scale=scale)
    got = K.reference_tree_attention(q, k, v, m, scale)
    assert torch.allclose(got, want.to(got.dtype), atol=1e-6)


def test_pack_unpack_round_trip_and_sign_bit():
    tree = K.random_tree_mask(3, 70, torch.Generator().manual_seed(0))
    packed = K.pack_tree_mask(tree)
    assert packed.shape == (3, 70, 3) and packed.dtype == torch.int32
    assert torch.equal(K.unpack_tree_mask(packed, 70), tree)
    # row 31 sees token 31 (itself): bit 31 of word 0 is the int32 sign bit
    assert int(packed[0, 31, 0]) < 0


def test_private_packer_agrees_with_the_onnx_helpers():
    tm = pytest.importorskip("specfoundry.export.onnx.tree_mask")
    tree = K.random_tree_mask(2, 45, torch.Generator().manual_seed(1))
    assert torch.equal(K.pack_tree_mask(tree), tm.pack_tree_mask(tree))
    assert torch.equal(K.unpack_tree_mask(tm.pack_tree_mask(tree), 45), tm.unpack_tree_mask(tm.pack_tree_mask(tree)))


def test_reference_agrees_with_the_onnx_op_reference():
    ta = pytest.importorskip("specfoundry.export.onnx.tree_attention")
    q, k, v, m, scale = K.make_case(1, 4, 2, 35, 6, 16, torch.float32, seed=5)
    assert torch.allclose(K.reference_tree_attention(q, k, v, m, scale),
                          ta.tree_attention_reference(q, k, v, m, scale), atol=1e-6)


def test_launcher_rejects_bad_shapes():
    q, k, v, m, scale = K.make_case(1, 3, 2, 5, 0, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        K.tree_attention(q, k, v, m, scale)
    q, k, v, m, scale = K.make_case(1, 2, 1, 5, 0, 16, torch.float32)
    with pytest.raises(ValueError, match="tree_mask"):
        K.tree_attention(q, k, v, m[:, :, :0], scale)


# ---------------------------------------------------------------------------------------------
# AOT PTX and the plugin ABI (no GPU needed)

@pytest.fixture(scope="module")
def compiled():
    return {(arch, dt): aot.compile_tree_attention(arch, dt, 64, 0.125)
            for arch, dt in ((80, "fp16"), (90, "fp16"), (90, "bf16"))}


def _runtime_param_names():
    return [p.name for p in K.tree_attention_kernel.params if not p.is_constexpr]


@pytest.mark.parametrize("key", [(80, "fp16"), (90, "fp16"), (90, "bf16")])
def test_plugin_launch_args_match_the_ptx_entry(compiled, key):
    k = compiled[key]
    args = plugin.kernel_launch_args((2, 9, 16, 64), (2, 3, 100, 64))
    # names and order: the plugin's list is the kernel's runtime signature, read from the JIT function
    assert [a.name for a in args] == _runtime_param_names()
    # count, order and pointer/int kind: the plugin's list is the launchable PTX entry, read from the PTX
    assert plugin.abi_mismatch(args, k) is None
    assert plugin.ptx_abi(args) == ["ptr"] * 4 + ["u32"] * 4 + ["ptr"]
    assert k.params == aot.parse_entry_params(k.ptx, k.name)
    # Triton's raw entry has two more (scratch) pointers, which TensorRT would not pass
    assert len(k.raw_params) == len(args) + aot.N_TRITON_SCRATCH_PARAMS
    assert [p.kind for p in k.raw_params[len(args):]] == ["ptr", "ptr"]
    assert plugin.abi_mismatch(args, _with_params(k, k.raw_params)) is not None


def _with_params(k, params):
    import dataclasses

    return dataclasses.replace(k, params=tuple(params))


def test_abi_check_catches_drift(compiled):
    k = compiled[(80, "fp16")]
    args = plugin.kernel_launch_args((1, 2, 8, 64), (1, 1, 20, 64))
    dropped = args[:5] + args[6:]  # a scalar lost
    swapped = args[:3] + [args[4], args[3]] + args[5:]  # a pointer and an int exchanged
    assert "takes 9" in plugin.abi_mismatch(dropped, k)
    assert plugin.abi_mismatch(swapped, k) is not None


def test_ptx_targets_and_version(compiled):
    assert ".target sm_80" in compiled[(80, "fp16")].ptx
    assert ".target sm_90a" in compiled[(90, "fp16")].ptx
    for k in compiled.values():
        assert f".version {aot.DEFAULT_PTX_VERSION // 10}.{aot.DEFAULT_PTX_VERSION % 10}" in k.ptx
        assert k.threads_per_block == 128 and 0 < k.shared_mem <= aot.MAX_STATIC_SHARED


def test_cubin_assembled_when_ptxas_exists(compiled):
    if aot.find_ptxas() is None:
        pytest.skip("no ptxas on PATH")
    for k in compiled.values():
        assert k.cubin and k.cubin[:4] == b"\x7fELF"


def test_strip_refuses_a_used_parameter():
    ptx = (".visible .entry f(\n\t.param .u64 .ptr .global .align 1 f_param_0,\n\t.param .u32 f_param_1\n)\n"
           "{\n\tld.param.b32 %r1, [f_param_1];\n\tret;\n}\n")
    with pytest.raises(aot.AotError, match="f_param_1"):
        aot.strip_trailing_params(ptx, "f", 1)
    assert [p.name for p in aot.parse_entry_params(aot.strip_trailing_params(ptx.replace("[f_param_1]", "[x]"), "f", 1))] == ["f_param_0"]


def test_launch_dims():
    assert plugin.launch_dims((2, 9, 33, 64), block_m=16, num_warps=4) == {"grid": (3, 18, 1), "block": (128, 1, 1)}


def test_write_ptx_takes_specs_from_the_onnx_graphs(tmp_path):
    pytest.importorskip("onnxruntime")
    from specfoundry.export.trt.gpu_check import one_node_model

    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "speculator.plugin.onnx").write_bytes(
        one_node_model("float16", 0.125, 64, 9, 3).SerializeToString())
    specs = aot.tree_attention_specs(tmp_path / "onnx")
    assert [(s["head_dim"], s["scale"], s["dtype"]) for s in specs] == [(64, 0.125, "fp16")]
    entry = aot.write_ptx(tmp_path / "trt", archs=(80,))
    assert "tree_attention_sm80_fp16_d64_m16n32.ptx" in entry["files"] and "kernels.json" in entry["files"]
    manifest = json.loads((tmp_path / "trt" / "kernels.json").read_text())
    assert manifest["kernels"][0]["params"][-1]["is_pointer"] and len(manifest["kernels"][0]["params"]) == 9


# ---------------------------------------------------------------------------------------------
# plugin registration and engines without TensorRT

def test_plugin_module_imports_without_tensorrt_and_register_says_why():
    if plugin.tensorrt_available():
        pytest.skip("tensorrt is installed here")
    with pytest.raises(plugin.TensorRTUnavailable, match="TensorRT"):
        plugin.register_plugin()


def test_build_engines_without_tensorrt_is_one_clear_sentence(tmp_path):
    if plugin.tensorrt_available() and engine.cuda_device_count() > 0:
        pytest.skip("TensorRT and a GPU are present")
    onnx_dir, out_dir = tmp_path / "onnx", tmp_path / "trt"
    onnx_dir.mkdir()
    out_dir.mkdir()
    (onnx_dir / "target.plugin.onnx").write_bytes(b"")
    (out_dir / "tree_attention_sm80_fp16_d64_m16n32.ptx").write_text("//")
    with pytest.raises(engine.EngineUnavailable) as info:
        engine.build_engines(onnx_dir, out_dir)
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0, msg
    assert ("tensorrt" in msg.lower() or "GPU" in msg) and "target.plugin.onnx" in msg and "1 PTX" in msg, msg


def test_profile_shapes_resolve_named_and_derived_dims():
    dims = {"query": ["batch", 9, "tree_tokens", 64], "key": ["batch", 3, "past + tree_tokens", 64],
            "tree_mask": ["batch", "tree_tokens", "(tree_tokens + 31) // 32"], "pos": ["batch", "s7"]}
    prof = engine._normalise_profiles({"batch": (1, 2, 4), "tree_tokens": (1, 16, 64), "past": (0, 100, 1000)})[0]
    shapes = engine.profile_shapes(dims, prof, dim_symbols={"s7": "T"})
    assert shapes["key"] == ((1, 3, 1, 64), (2, 3, 116, 64), (4, 3, 1064, 64))
    assert shapes["tree_mask"] == ((1, 1, 1), (2, 16, 1), (4, 64, 2))
    assert shapes["pos"] == ((1, 1), (2, 16), (4, 64))
    with pytest.raises(ValueError, match="dim_symbols"):
        engine.profile_shapes({"x": ["mystery"]}, prof)
    with pytest.raises(ValueError, match="min <= opt <= max"):
        engine._normalise_profiles({"past": (5, 1, 10)})


def test_aot_attribute_is_added_to_tree_attention_nodes(tmp_path):
    import onnx

    from specfoundry.export.trt.gpu_check import one_node_model

    path = tmp_path / "m.onnx"
    path.write_bytes(one_node_model("float32", 0.25, 16, 2, 1).SerializeToString())
    model = onnx.load_from_string(engine.with_aot_attribute(path, True))
    (node,) = [n for n in model.graph.node if n.op_type == "TreeAttention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["aot"] == 1 and attrs["plugin_namespace"] == b"specfoundry" and attrs["scale"] == 0.25


# ---------------------------------------------------------------------------------------------
# the GPU check on this machine

def test_gpu_check_runs_and_reports_every_section(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, "-m", "specfoundry.export.trt.gpu_check", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = json.loads((out / "gpu_check.json").read_text())
    sections = summary["sections"]
    assert list(sections) == ["golden_cpu", "aot_compile", "triton_kernel", "aot_ptx_launch", "golden_vs_cuda",
                              "tensorrt"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["ok"] is True
    assert sections["golden_cpu"]["status"] == "ok" and sections["aot_compile"]["status"] == "ok"
    assert (out / "golden.npz").is_file()
    if not torch.cuda.is_available():
        for name in ("triton_kernel", "aot_ptx_launch", "golden_vs_cuda"):
            assert sections[name]["status"] == "skipped" and "CUDA" in sections[name]["reason"], sections[name]
    if not plugin.tensorrt_available():
        assert sections["tensorrt"]["status"] == "skipped" and "tensorrt" in sections["tensorrt"]["reason"]
    for rec in sections.values():
        assert rec["status"] in ("ok", "skipped") and (rec["status"] == "ok" or rec["reason"])


# ---------------------------------------------------------------------------------------------
# GPU and TensorRT tiers

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_on_cuda(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for name in K.CASES:
        r = K.run_case(name, dtype, device="cuda")
        assert r["ok"], r


@pytest.mark.gpu
def test_build_engines_with_tensorrt(tmp_path):
    pytest.importorskip("tensorrt")
    if engine.cuda_device_count() == 0 or not torch.cuda.is_available():
        pytest.skip("TensorRT needs a CUDA GPU (and a CUDA build of torch for the plugin)")
    from specfoundry.export.trt.gpu_check import one_node_model

    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    for name in engine.MODELS.values():
        (onnx_dir / name).write_bytes(one_node_model("float16", 0.125, 64, 4, 2).SerializeToString())
    manifest = engine.build_engines(onnx_dir, tmp_path / "trt",
                                    profiles={"batch": (1, 1, 2), "tree_tokens": (1, 8, 32), "past": (0, 16, 64)})
    assert set(manifest["engines"]) == {"target", "speculator", "speculator_fuse"}
    assert (tmp_path / "trt" / "target.engine").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# the QDP functions themselves, against a stand-in for tensorrt.plugin (TensorRT is absent here)

class _Expr(int):
    """A constant shape expression: an int that answers TensorRT's ShapeExpr queries."""
    is_fake = False
    is_constant = True

    def constant_value(self):
        return int(self)


class _Desc:
    def __init__(self, dtype, shape):
        self.dtype = dtype
        self.shape_expr = [_Expr(d) for d in shape]
        self.shape = tuple(shape)


def _stub_tensorrt(monkeypatch):
    import inspect
    import types

    trt = types.ModuleType("tensorrt")
    trt.float16, trt.bfloat16, trt.float32, trt.int32 = "HALF", "BF16", "FLOAT", "INT32"
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.captured = {}

    def decorator(kind):
        def by_id(plugin_id):
            def deco(fn):
                trtp.captured[kind] = (plugin_id, fn, inspect.signature(fn))
                return fn
            return deco
        return by_id

    for kind in ("register", "impl", "aot_impl", "autotune"):
        setattr(trtp, kind, decorator(kind))

    class SymInt32:
        def __init__(self, value):
            self.value = value

    class KernelLaunchParams:  # like TensorRT's: every field is stored as a SymInt32
        def __setattr__(self, name, value):
            object.__setattr__(self, name, SymInt32(value))

    class SymExprs(list):
        pass

    class SymIntExprs(SymExprs):
        @classmethod
        def from_tuple(cls, items):
            return cls(items)

    class AutoTuneCombination:
        def __init__(self, io_types, layouts, tactics):
            self.io_types, self.layouts, self.tactics = io_types, layouts, tactics

    trtp.TensorDesc, trtp.Tensor = type("TensorDesc", (), {}), type("Tensor", (), {})
    trtp.KernelLaunchParams, trtp.SymInt32, trtp.SymExprs, trtp.SymIntExprs = KernelLaunchParams, SymInt32, SymExprs, SymIntExprs
    trtp.AutoTuneCombination = AutoTuneCombination
    trtp.cdiv = lambda a, b: -(-a // b)
    trt.plugin = trtp
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(plugin, "_device_arch", lambda: 80)
    return trt, trtp


def test_qdp_signatures_and_aot_impl_with_a_tensorrt_stand_in(monkeypatch):
    trt, trtp = _stub_tensorrt(monkeypatch)
    plugin.register_plugin()
    cap = trtp.captured
    assert {pid for pid, _, _ in cap.values()} == {plugin.PLUGIN_ID}
    tensors, attrs = ["query", "key", "value", "tree_mask"], ["scale"]
    # the parameter schemas tensorrt.plugin enforces for each decorator
    assert list(cap["register"][2].parameters) == tensors + attrs
    assert list(cap["impl"][2].parameters) == tensors + attrs + ["outputs", "stream", "tactic"]
    assert list(cap["aot_impl"][2].parameters) == tensors + attrs + ["outputs", "tactic"]
    assert list(cap["autotune"][2].parameters) == tensors + ["outputs"]
    (combo,) = cap["autotune"][1](*[None] * 4, None)
    assert [t.strip() for t in combo.io_types.split(",")][3] == "INT32" and combo.tactics == list(plugin.TACTICS)

    B, HQ, HKV, T, P, D = 2, 9, 3, 40, 100, 64
    q, k = _Desc(trt.float16, (B, HQ, T, D)), _Desc(trt.float16, (B, HKV, P + T, D))
    v, m = _Desc(trt.float16, (B, HKV, P + T, D)), _Desc(trt.int32, (B, T, 2))
    name, ptx, params, extra = cap["aot_impl"][1](q, k, v, m, 0.125, (q,), 2)
    compiled = aot.compile_tree_attention(80, "fp16", D, 0.125, block_n=plugin.TACTICS[2])
    assert name == compiled.name and ptx == compiled.ptx and ".target sm_80" in ptx
    assert (params.grid_x.value, params.grid_y.value, params.grid_z.value) == (3, B * HQ, 1)
    assert (params.block_x.value, params.block_y.value, params.block_z.value) == (128, 1, 1)
    assert params.shared_mem.value == compiled.shared_mem
    assert [int(e.value) for e in extra] == [T, P + T, HQ, HKV]  # K.INT_SCALARS order
