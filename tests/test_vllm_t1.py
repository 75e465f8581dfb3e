"""The vLLM T>0 bug (docs/vllm-cpu-t1-bug.md) without vLLM: the repro's logic
(bench/vllm_t1_repro.py) on a fake C++ kernel, the fix, its in-process installation against
fake vLLM modules, ``specfoundry check-vllm``'s pooling/tolerance, and the bench's marking of
vLLM speculative rows at T>0 as not target samples."""

import sys
import types

import pytest
import torch

from specfoundry.bench import vllm_t1_repro as repro
from specfoundry.bench.check_vllm import pool_vllm, within
from specfoundry.bench.report import NOT_TARGET_MARK, VLLM_T1_OK, vllm_t1_caveat

pytestmark = pytest.mark.usefixtures("single_thread")


def fake_cpp_expand(output, input_val, cu_num_tokens, replace_from, replace_to):
    """Stands in for ``torch.ops._C.expand_kernel_impl`` (vLLM's C++ op): like it, refuses any
    tensor that is not int64 ("expected scalar type Long"), and writes ``output`` in place."""
    for t in (output, input_val, cu_num_tokens):
        if t.dtype != torch.int64:
            raise RuntimeError(f"expected scalar type Long but found {t.dtype}")
    start = 0
    for v, end in zip(input_val.tolist(), cu_num_tokens.tolist()):
        output[start:end] = replace_to if v == replace_from else v
        start = end


def shipped_expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM 0.32.0's ``vllm/utils/cpu_triton_utils.py:_expand_kernel_impl`` (lines 390-404), with
    the fake op: the op writes into ``_ensure_int64(output)``, a copy, and nothing copies it back."""
    ensure = lambda t: t if t.dtype == torch.int64 else t.to(torch.int64)  # noqa: E731
    fake_cpp_expand(ensure(output), ensure(input_val), ensure(cu_num_tokens), replace_from, replace_to)


@pytest.fixture
def fake_op(monkeypatch):
    monkeypatch.setattr(repro, "_cpp_op", lambda: fake_cpp_expand)
    return fake_cpp_expand


def test_expected_expand_is_the_docstring_example():
    assert repro.expected_expand(["a", "b", "c"], [2, 5, 6], 6) == ["a", "a", "b", "b", "b", "c"]
    assert repro.expected_expand([0.7, 1.0, 0.0], [2, 5, 6], 6, 0, 1) == [0.7, 0.7, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        repro.expected_expand([1.0], [2], 3)


def test_shipped_wrapper_leaves_the_temperatures_uninitialised(fake_op):
    # the buffer expand_batch_to_tokens returns is x.new_empty(num_tokens): fill the allocator's
    # memory with a sentinel first so "untouched" is visible (the real one holds garbage)
    def expand(x, cu, n, replace_from=0, replace_to=0):
        out = torch.full((n,), -123.0, dtype=x.dtype)
        shipped_expand_kernel_impl(out, x, cu, replace_from, replace_to)
        return out

    r = repro.check_expand(expand, torch)
    assert not r["ok"]
    assert r["expected"] == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.0])
    assert r["observed"] == [-123.0] * 6  # never written
    # the same wrapper through the repro's inlined expand_batch_to_tokens (new_empty): still wrong
    assert not repro.check_expand(repro.expand_with(shipped_expand_kernel_impl, torch), torch)["ok"]


def test_copy_back_alone_truncates_float_temperatures(fake_op):
    r = repro.check_expand(repro.expand_with(repro.copy_back_only_expand_kernel_impl, torch), torch)
    assert not r["ok"]
    assert r["observed"] == [1.0] * 6  # 0.7 -> int64 0 -> replace_from 0 -> 1


@pytest.mark.parametrize("with_op", [True, False])
def test_fixed_impl_matches_the_triton_kernel_for_every_dtype(monkeypatch, with_op):
    monkeypatch.setattr(repro, "_cpp_op", lambda: fake_cpp_expand if with_op else None)
    assert repro.check_expand(repro.expand_with(repro.fixed_expand_kernel_impl, torch), torch)["ok"]
    cu = torch.tensor([1, 1, 4], dtype=torch.int32)  # a request with no draft tokens in the middle
    for dtype, x, want in [(torch.float32, [0.5, 2.0, 0.0], [0.5, 1.0, 1.0, 1.0]),
                           (torch.int32, [50, 7, 0], [50, 1, 1, 1]),  # top_k is int32 in vLLM
                           (torch.int64, [3, 4, 0], [3, 1, 1, 1])]:
        out = torch.full((6,), -1, dtype=dtype)  # longer than cu[-1]: the tail stays untouched
        repro.fixed_expand_kernel_impl(out, torch.tensor(x, dtype=dtype), cu, 0, 1)
        assert out.tolist() == pytest.approx(want + [-1, -1]), dtype
    empty = torch.full((2,), 9.0)
    repro.fixed_expand_kernel_impl(empty, torch.zeros(0), torch.zeros(0, dtype=torch.int32), 0, 1)
    assert empty.tolist() == [9.0, 9.0]


def test_check_expand_catches_nondeterministic_garbage_and_wrong_dtype():
    calls = []

    def sometimes_right(x, cu, n, replace_from=0, replace_to=0):
        calls.append(1)
        good = torch.tensor(repro.expected_expand(x.tolist(), cu.tolist(), n, replace_from, replace_to))
        return good if len(calls) < 3 else good + 1  # the third trial differs

    assert not repro.check_expand(sometimes_right, torch)["ok"]
    as_int = lambda x, cu, n, replace_from=0, replace_to=0: torch.ones(n, dtype=torch.int64)  # noqa: E731
    assert not repro.check_expand(as_int, torch, case={**repro.CASE, "x": [1.0, 1.0, 1.0]})["ok"]


def test_report_formats_expected_and_observed():
    ok = {"expected": [0.7, 0.7, 1.0, 1.0, 1.0, 1.0], "observed": [0.7, 0.7, 1.0, 1.0, 1.0, 1.0], "ok": True}
    bad = {**ok, "observed": [1.4e-36, 0.0, 8.8e9, 1.0, 1.0, 1.0], "ok": False}
    text = repro.report({"vLLM as shipped": bad, "proposed fix": ok})
    assert "vLLM as shipped    [1.4e-36, 0, 8.8e+09, 1, 1, 1]  WRONG" in text
    assert "proposed fix       [0.7, 0.7, 1, 1, 1, 1]  ok" in text


@pytest.fixture
def fake_vllm(monkeypatch):
    """Just enough of vLLM's module tree for install_fix: the CPU fallback module and the
    kernel-override registry."""
    cpu_tl = types.ModuleType("vllm.utils.cpu_triton_utils")
    cpu_tl._expand_kernel_impl = shipped_expand_kernel_impl
    disp = types.ModuleType("vllm.triton_utils.dispatcher")
    disp._registry = {}
    disp.registered = []
    disp.register_kernels = lambda m: disp.registered.append(dict(m))
    mods = {"vllm": types.ModuleType("vllm"), "vllm.utils": types.ModuleType("vllm.utils"),
            "vllm.utils.cpu_triton_utils": cpu_tl, "vllm.triton_utils": types.ModuleType("vllm.triton_utils"),
            "vllm.triton_utils.dispatcher": disp}
    mods["vllm.utils"].cpu_triton_utils = cpu_tl
    mods["vllm.triton_utils"].dispatcher = disp
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    return cpu_tl, disp


def test_install_fix_before_the_worker_registers(fake_vllm):
    cpu_tl, disp = fake_vllm
    done = repro.install_fix()
    assert cpu_tl._expand_kernel_impl is repro.fixed_expand_kernel_impl  # what the worker will register
    assert disp.registered == [] and "reregistered" not in done


def test_install_fix_after_the_worker_registered(fake_vllm):
    cpu_tl, disp = fake_vllm
    disp._registry[repro.KERNEL] = (object(), shipped_expand_kernel_impl)
    done = repro.install_fix()
    assert disp.registered == [{repro.KERNEL: repro.fixed_expand_kernel_impl}]
    assert done["reregistered"] == repro.KERNEL


def test_pool_vllm_and_tolerance():
    out = {"results": [
        {"token_ids": [1, 2], "seconds": 1.0, "stats": {"drafted": 9, "accepted": 4, "target_forwards": 3,
                                                         "tried": [3, 2, 1], "passed": [2, 1, 1]}},
        {"token_ids": [3], "seconds": 2.0, "stats": {"drafted": 3, "accepted": 0, "target_forwards": 1,
                                                      "tried": [1, 0, 0], "passed": [0, 0, 0]}}]}
    p = pool_vllm(out)
    assert p["drafts"] == 4 and p["accepted"] == 4 and p["drafted"] == 12 and p["seconds"] == 3.0
    assert p["mean_acceptance_length"] == 2.0
    assert p["acceptance_by_position"] == [0.5, 0.5, 1.0]
    assert p["outputs"] == [[1, 2], [3]]
    assert pool_vllm({"results": []})["mean_acceptance_length"] is None
    assert within(1.95, 2.0) == (True, pytest.approx(0.025))
    assert within(1.7, 2.0)[0] is False
    assert within(None, 2.0) == (False, None)


def test_vllm_speculative_rows_at_t_gt_0_are_marked_unless_the_engine_check_passed():
    spec = {"name": "vllm-eagle3@3", "note": "separate engine process"}
    assert "not target samples" in vllm_t1_caveat(spec, 1.0)
    assert "docs/vllm-cpu-t1-bug.md" in vllm_t1_caveat(spec, 1.0)
    assert vllm_t1_caveat(spec, 0.0) is None  # greedy returns before the bug
    assert vllm_t1_caveat({"name": "vllm", "note": ""}, 1.0) is None  # plain vLLM: no rejection sampler
    assert vllm_t1_caveat({**spec, "note": f"x; T=1: {VLLM_T1_OK} in the engine"}, 1.0) is None
    assert vllm_t1_caveat({**spec, "note": f"x; T=0.7: {VLLM_T1_OK} in the engine"}, 1.0) is not None


def test_bench_report_marks_the_rows(tmp_path):
    from specfoundry.bench.cli import write_report

    def rec(method, T):
        return {"temperature": T, "repeat": 0, "dataset": "builtin", "category": "code", "question_id": "q1", "turn": 0,
                "method": method, "order": 0, "new_tokens": 8, "seconds": 1.0, "tokens_per_second": 8.0,
                "plain_seconds": 1.0, "plain_new_tokens": 8, "speed_up": 1.0, "wall_ratio": 1.0,
                "check": {"status": "n/a"}, "tau": 1.5, "tried": [4, 2], "passed": [2, 1], "drafted": 8, "accepted": 3,
                "target_forwards": 4, "acceptance_by_position": [0.5, 0.5]}

    methods = [{"name": "plain", "label": "plain", "kind": "plain", "interleaved": True, "check": "strict", "draft_depth": None},
               {"name": "vllm-eagle3@3", "label": "vLLM + head", "kind": "peer", "interleaved": False, "check": "strict",
                "draft_depth": 3, "note": "separate engine process"}]
    raw = {"records": [rec(m, T) for m in ("plain", "vllm-eagle3@3") for T in (0.0, 1.0)], "errors": [], "seconds": 1.0}
    settings = {"target": "t", "dtype": "float32", "temperatures": [0.0, 1.0], "max_new_tokens": 8, "repeats": 1,
                "seed": 0, "stop_at_eos": True, "datasets": ["builtin"], "limit": None}
    env = {"python": "3", "torch": "2", "transformers": "4", "platform": "p", "machine": "m", "cpu_count": 2,
           "torch_threads": 1, "git_commit": "x"}
    write_report(tmp_path, raw, methods, [], settings, env)
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["T=1"]["overall"]["vllm-eagle3@3"]["caveat"].startswith("not target samples")
    assert report["summary"]["T=1"]["by_category"]["builtin:code"]["vllm-eagle3@3"]["caveat"]
    assert report["summary"]["T=0"]["overall"]["vllm-eagle3@3"]["caveat"] is None
    assert report["summary"]["T=1"]["overall"]["plain"]["caveat"] is None
    md = (tmp_path / "report.md").read_text()
    t1 = md[md.index("## T=1: overall"):]
    assert f"| `vllm-eagle3@3` † {NOT_TARGET_MARK} |" in t1
    t0 = md[md.index("## T=0: overall"):md.index("## T=1: overall")]
    assert NOT_TARGET_MARK not in t0
    assert f"- {NOT_TARGET_MARK} (T=1) not target samples (vLLM CPU bug, see docs/vllm-cpu-t1-bug.md)" in md


def test_check_vllm_is_a_cli_command():
    from specfoundry.runtime.cli import build_parser

    args = build_parser().parse_args(["check-vllm", "--recipe", "r", "--k", "2", "--temperature", "1", "--no-shipped"])
    assert args.command == "check-vllm" and args.k == 2 and args.no_shipped and callable(args.func)


@pytest.mark.parametrize("engine_ok", [False, True])
def test_bench_vllm_peer_writes_the_engine_check_into_its_note(monkeypatch, tmp_path, engine_ok):
    # the bench's vllm-eagle3 peer: the engine process reports its expand_batch_to_tokens check,
    # and the method's note says so, which decides the row's mark (a fixed vLLM loses the mark)
    import specfoundry.bench.external as external
    import specfoundry.export.serving as serving
    import specfoundry.runtime.models as models
    import specfoundry.runtime.speculators as speculators

    monkeypatch.setattr(serving, "export_vllm", lambda *a, **k: {"status": "written"})
    monkeypatch.setattr(speculators, "load_speculator", lambda *a, **k: object())
    monkeypatch.setattr(models, "resolve_target_path", lambda s: (tmp_path, None))
    check = {"input": dict(repro.CASE), "expected": [0.7] * 2 + [1.0] * 4, "ok": engine_ok,
             "observed": [0.7] * 2 + [1.0] * 4 if engine_ok else [1e-43, 0.0, 7e-44, 0.0, 0.0, 0.0]}
    requests = []

    def fake_engine(python, script, request, work, name, timeout=None):
        requests.append(request)
        return {"expand_check": check, "results": [{"token_ids": [5, 6], "seconds": 0.5, "stats": None}]}

    monkeypatch.setattr(external, "_run_engine", fake_engine)
    target = types.SimpleNamespace(dtype=torch.float32)
    source = types.SimpleNamespace(path=tmp_path, run="runs/x")
    m = external.external_method("vllm-eagle3", 3, target, "smollm2-135m", tmp_path, source)
    assert vllm_t1_caveat(m.describe(), 1.0) is not None  # before any run: marked
    m.batch_runner([[1, 2, 3]], 2, 0.0, [0], True)
    assert vllm_t1_caveat(m.describe(), 1.0) is not None  # a greedy run says nothing about T=1
    out = m.batch_runner([[1, 2, 3]], 2, 1.0, [0], True)
    assert out[0].token_ids == [5, 6] and not requests[-1].get("fix_expand")  # the bench never applies the fix
    assert (vllm_t1_caveat(m.describe(), 1.0) is None) == engine_ok
    if not engine_ok:
        assert "vLLM CPU bug" in m.note and "1e-43" in m.note
