"""Measured choices kept per machine (runtime/choices.py) and the engine's kernel choice read back from them."""

import json

import pytest
import torch

from specfoundry.runtime import choices
from specfoundry.runtime.engine import LlamaEngine
from tiny_models import tiny_llama


@pytest.fixture
def keep(monkeypatch, tmp_path):
    """Choices kept under a fresh cache (conftest's default measures every time)."""
    monkeypatch.setenv("SPECFOUNDRY_CACHE", str(tmp_path))
    monkeypatch.setenv(choices.CHOICES_ENV, "keep")
    # as on a quiet machine (under xdist the other worker's tests keep a core busy: nothing would be kept)
    monkeypatch.setattr(choices, "_others_cores", lambda before: 0.0)
    return tmp_path


def _counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value

    return measure, calls


def test_a_choice_is_measured_once_then_read_back(keep):
    measure, calls = _counting(["a", "b"])
    value, where = choices.kept("k", {"x": 1}, measure)
    assert value == ["a", "b"] and len(calls) == 1 and where.startswith("measured, kept in ")
    path = choices.choice_path("k", {"x": 1})
    assert path.is_relative_to(keep) and json.loads(path.read_text())["value"] == ["a", "b"]
    assert choices.kept("k", {"x": 1}, measure) == (["a", "b"], f"kept in {path}") and len(calls) == 1
    # other parts are another choice
    assert choices.kept("k", {"x": 2}, _counting(["c"])[0])[0] == ["c"]
    assert choices.choice_path("k", {"x": 2}) != path and choices.kept("k", {"x": 1}, measure)[0] == ["a", "b"]


def test_an_unreadable_or_rejected_choice_is_measured_again_and_replaced(keep):
    path = choices.choice_path("k", {})
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    measure, calls = _counting(["m"])
    assert choices.kept("k", {}, measure)[0] == ["m"] and len(calls) == 1
    assert choices.kept("k", {}, measure, valid=lambda v: v != ["m"])[0] == ["m"] and len(calls) == 2
    path.write_text(json.dumps({"no value": 1}))
    assert choices.kept("k", {}, measure)[0] == ["m"] and len(calls) == 3
    assert choices.kept("k", {}, measure)[1] == f"kept in {path}" and len(calls) == 3


def test_renew_measures_again_and_measure_keeps_nothing(keep, monkeypatch):
    choices.kept("k", {}, lambda: ["old"])
    monkeypatch.setenv(choices.CHOICES_ENV, "renew")
    assert choices.kept("k", {}, lambda: ["new"])[0] == ["new"]
    monkeypatch.setenv(choices.CHOICES_ENV, "keep")
    assert choices.kept("k", {}, lambda: ["other"])[0] == ["new"]
    monkeypatch.setenv(choices.CHOICES_ENV, "measure")
    measure, calls = _counting(["each"])
    assert choices.kept("k", {}, measure) == (["each"], "measured") and choices.kept("k", {}, measure)[0] == ["each"]
    assert len(calls) == 2 and not choices.choice_path("k2", {}).exists()
    monkeypatch.setenv(choices.CHOICES_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECFOUNDRY_CHOICES='sometimes'"):
        choices.kept("k", {}, measure)


def test_the_engine_measures_its_kernels_once_per_machine_and_thread_count(keep, monkeypatch, single_thread):
    target = tiny_llama(0)  # its engine, built here, measured
    model, first = target.model, target.engine
    assert first.kernels_from.startswith("measured, kept in ")

    def not_again(self, *a):
        raise AssertionError("measured although kept")

    monkeypatch.setattr(LlamaEngine, "_choose_kernels", not_again)
    monkeypatch.setattr(LlamaEngine, "_forward_seconds", not_again)
    again = LlamaEngine(model)
    assert again.kernels == first.kernels and again.kernels_from.startswith("kept in ")
    # what is kept is what runs (here a choice the measurement would not make), its weights prepared
    for kind in ("engine-products", "engine-kernels"):
        for path in (keep / "choices").glob(f"{kind}-*.json"):
            record = json.loads(path.read_text())
            path.write_text(json.dumps({**record, "value": ["gemv_t", "aten"]}))
    kept = LlamaEngine(model)
    assert kept.kernels == ("gemv_t", "aten")
    with torch.inference_mode():
        plain = kept.forward(torch.tensor([[1, 2, 3]]), kept.new_cache(capacity=8)).logits
        ref = first.forward(torch.tensor([[1, 2, 3]]), first.new_cache(capacity=8)).logits
    assert torch.allclose(plain, ref, rtol=1e-9, atol=1e-9)
    # another thread count (or model, dtype, offered kernels, kernel sources) is another choice
    torch.set_num_threads(2)
    with pytest.raises(AssertionError, match="measured although kept"):
        LlamaEngine(model)
    # given kernels are neither measured nor kept
    assert LlamaEngine(model, kernels=("aten", "aten")).kernels_from == "given"


def test_a_choice_measured_while_other_processes_ran_is_used_not_kept(keep, monkeypatch):
    monkeypatch.setattr(choices, "_others_cores", lambda before: choices.BUSY_CORES + 0.5)
    measure, calls = _counting(["busy"])
    value, where = choices.kept("k", {}, measure)
    assert value == ["busy"] and where.startswith("measured, not kept: other processes kept 1.0 cores busy")
    assert not choices.choice_path("k", {}).exists()
    monkeypatch.setattr(choices, "_others_cores", lambda before: 0.0)
    assert choices.kept("k", {}, measure)[1].startswith("measured, kept in ") and len(calls) == 2


@pytest.mark.skipif(choices._busy_seconds() is None, reason="no /proc/stat here")
def test_other_processes_cpu_time_is_seen():
    import subprocess
    import sys
    import time

    before = choices._busy_seconds()
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    time.sleep(1.0)  # this process idle: the spinning child (not yet waited for) is another process's work
    others = choices._others_cores(before)
    spin.wait()
    assert others >= 0.5


def test_the_fma_path_choice_is_kept_too(keep, monkeypatch):
    from specfoundry.runtime import cpu_gemv

    if not cpu_gemv.fma_exact():
        pytest.skip("the AVX-512 BF16 kernel's FMA path does not run on this CPU (nothing to choose)")
    cpu_gemv.fma_rows.cache_clear()
    try:
        first = cpu_gemv.fma_rows()
        cpu_gemv.fma_rows.cache_clear()
        monkeypatch.setattr(cpu_gemv, "best_seconds", lambda *a, **k: pytest.fail("timed although kept"))
        assert cpu_gemv.fma_rows() == first
        (path,) = (keep / "choices").glob("fma-rows-*.json")
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "value": [] if first else [2, 3, 4, 5, 6, 7, 8]}))
        cpu_gemv.fma_rows.cache_clear()
        assert cpu_gemv.fma_rows() == (() if first else (2, 3, 4, 5, 6, 7, 8))  # what is kept is what runs
    finally:
        monkeypatch.undo()
        cpu_gemv.fma_rows.cache_clear()
        cpu_gemv.fma_rows()  # this process's own choice again (measured: conftest's default)


def test_the_cost_curve_is_measured_once_per_machine_then_kept(keep, monkeypatch, single_thread):
    from specfoundry.runtime import engine as engine_module

    target = tiny_llama(0)
    first = target.cost_curve(sizes=(1, 2, 4), past=8, reps=1)
    assert set(first) == {1, 2, 4} and first[1] == 1.0 and all(c > 0 for c in first.values())
    (path,) = (keep / "choices").glob("cost-curve-*.json")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "value": [[1, 1.0], [2, 1.5], [4, 3.25]]}))
    monkeypatch.setattr(engine_module, "best_seconds", lambda *a, **k: pytest.fail("timed although kept"))
    target.engine.__dict__.pop("curves")  # a new process's engine: nothing measured in it yet
    assert target.cost_curve(sizes=(1, 2, 4), past=8, reps=1) == {1: 1.0, 2: 1.5, 4: 3.25}  # kept is what is used
    path.write_text(json.dumps({**record, "value": [[1, 1.0], [2, -1.0]]}))  # rejected: measured again
    target.engine.__dict__.pop("curves")
    with pytest.raises(pytest.fail.Exception, match="timed although kept"):
        target.cost_curve(sizes=(1, 2, 4), past=8, reps=1)


def test_choices_unused_for_long_are_removed_when_another_is_kept(keep):
    import os
    import time

    choices.kept("k", {"a": 1}, lambda: 1)
    choices.kept("k", {"a": 2}, lambda: 2)
    choices.kept("k-other", {"a": 1}, lambda: 3)  # a kind whose name starts with another's
    old, used = choices.choice_path("k", {"a": 1}), choices.choice_path("k", {"a": 2})
    other = choices.choice_path("k-other", {"a": 1})
    long_ago = time.time() - (choices.UNUSED_DAYS + 1) * 86400
    for path in (old, used, other):
        os.utime(path, (long_ago, long_ago))
    assert choices.kept("k", {"a": 2}, lambda: pytest.fail("measured although kept")) == (2, f"kept in {used}")
    assert used.stat().st_mtime > long_ago + 86400  # read back: marked used
    assert choices.kept("k", {"a": 3}, lambda: 4)[0] == 4  # keeping a new one prunes the unused
    assert not old.exists() and used.exists() and other.exists()


def test_the_two_row_path_is_measured_on_the_model_then_kept(keep, monkeypatch):
    from specfoundry.runtime import cpu_gemv, cpu_layers
    from specfoundry.runtime import engine as engine_module

    if not (cpu_layers.available() and cpu_gemv.fma_exact()):
        pytest.skip("no layer kernel with an FMA path that gives vdpbf16ps's bits here (nothing to choose)")
    monkeypatch.setattr(cpu_gemv, "fma_rows", lambda: ())  # (a CPU whose 2-row passes are on FMAs already: not asked)
    eng = LlamaEngine(tiny_llama(0, vocab=96, hidden=128, layers=2, dtype=torch.bfloat16).model,
                      ("avx512bf16", "avx512bf16", "avx512bf16"))
    # the measurement: a 2-token forward timed with the flag off and on, on by a margin only
    for off, on, want in ((2.0, 1.0, True), (1.0, 2.0, False), (1.0, 0.99, False)):
        monkeypatch.setattr(engine_module, "best_seconds", lambda fn, *a, **k: fn() or (on if eng.fma2 else off))
        assert eng._measure_two_rows() is want and eng.fma2 is False
    # measured once per machine and model, then read back (tiny_llama's own engine, built with the
    # kernels it measured, may have kept one already: gone)
    for path in (keep / "choices").glob("engine-fma2-*.json"):
        path.unlink()
    calls = []
    monkeypatch.setattr(LlamaEngine, "_measure_two_rows", lambda self: calls.append(1) or True)
    parts = eng._choice_parts()
    assert eng._two_rows_on_fma(parts) is True and eng._two_rows_on_fma(parts) is True and len(calls) == 1
    (path,) = (keep / "choices").glob("engine-fma2-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "value": False}))
    assert eng._two_rows_on_fma(parts) is False and len(calls) == 1  # what is kept is what runs
