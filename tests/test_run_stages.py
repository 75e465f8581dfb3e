"""Planned vs done per stage (issue 13, item 1): a stage a minute guard stops is recorded in
``train_summary.json`` and reported in the one line ``specfoundry train`` ends with.

The guards are made to fire deterministically by a fake clock in the modules that read the time
(data chunks, evaluation prompts), not by a real short budget: no assertion depends on speed."""

import argparse
import json
import time as _time

import pytest
import yaml

from specfoundry.train.stages import evaluation_stage, guard_line, training_stage
from tiny_models import TINY_PROMPTS, tiny_target_with_smollm2_tokenizer

PROMPTS = TINY_PROMPTS


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, smollm2):
    return tiny_target_with_smollm2_tokenizer(tmp_path_factory.mktemp("tiny-target"), smollm2.vocab_size)


class _JumpingClock:
    """``time()``/``perf_counter()`` that run normally until :meth:`jump`, then read an hour later."""

    def __init__(self):
        self.offset = 0.0

    def jump(self):
        self.offset = 3600.0

    def time(self):
        return _time.time() + self.offset

    def perf_counter(self):
        return _time.perf_counter() + self.offset


def test_guard_stopped_stages_are_recorded_and_reported(tmp_path, tiny_target_dir, monkeypatch, capsys):
    from specfoundry.train import datacache, distill, evaluate, generation
    from specfoundry.train.cli import run_train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    recipe = {
        "name": "tiny-guarded", "method": "medusa1", "output_dir": str(tmp_path / "run"),
        "target": {"name": str(tiny_target_dir), "dtype": "fp32", "device": "cpu"},
        "speculator": {"num_heads": 2, "draft_vocab_size": 256},  # (reduced-vocabulary Medusa end to end too)
        # 12 prompts - 3 held out = 9 examples planned, in chunks of 6: the guard fires after the first
        "data": {"prompts": [{"source": "file", "path": str(prompts), "limit": 12}],
                 "responses": {"max_new_tokens": 8, "batch_size": 2, "dtype": "fp32"},
                 "max_seq_len": 64, "eval_prompts": 3, "hidden_states": "offline", "max_minutes": 5,
                 "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 2, "batch_size": 1, "learning_rate": 1e-3, "precision": "fp32", "eval_every": 0},
        "tracking": {"wandb_mode": "disabled"},
        "evaluation": {"limit": 3, "max_new_tokens": 4, "temperatures": [0.0, 1.0], "depth": 2, "max_minutes": 5,
                       "baseline": False},
        "launcher": {"config": "single-cpu"},
    }
    path = tmp_path / "tiny-guarded.yaml"
    path.write_text(yaml.safe_dump(recipe))

    monkeypatch.setitem(distill.DEFAULT_RESPONSES, "chunk_size", 6)  # (recipes do not set it)
    data_clock, eval_clock = _JumpingClock(), _JumpingClock()
    monkeypatch.setattr(datacache, "time", data_clock)
    real_generate = generation.generate_batched

    def generate_then_run_out_of_time(*a, **kw):
        out = real_generate(*a, **kw)
        data_clock.jump()  # the first response chunk is done; the budget is over from here on
        return out

    monkeypatch.setattr(generation, "generate_batched", generate_then_run_out_of_time)
    calls = {"n": 0}

    def eval_perf_counter():  # call 1: the deadline; 2: T=0's share; 3: before prompt 0; from 4 on: past it
        calls["n"] += 1
        if calls["n"] == 4:
            eval_clock.jump()
        return eval_clock.perf_counter()

    monkeypatch.setattr(evaluate, "time", argparse.Namespace(perf_counter=eval_perf_counter))

    args = argparse.Namespace(recipe=str(path), dry_run=False, resume=False, overwrite=False, set=[], list=False,
                              smoke=False)
    assert run_train(args) == 0
    out_lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]

    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    st = summary["stages"]
    assert st["data"]["planned"] == 9 and st["data"]["done"] == 6 and st["data"]["stopped_by_guard"]
    assert st["data"]["guard"] == "data.max_minutes=5" and st["data"]["chunks_skipped"] == 1
    assert st["capture"]["stopped_by_guard"] is False
    assert st["training"] == {"unit": "steps", "planned": 2, "done": 2, "stopped_by_guard": False, "guard": None}
    cells = st["evaluation"]["cells"]
    assert cells["builtin-heldout T=0"]["done"] == 1 and cells["builtin-heldout T=0"]["planned"] == 3
    assert cells["builtin-heldout T=1"]["done"] == 0 and cells["builtin-heldout T=1"]["stopped_by_guard"]
    # the measured cells say so themselves: never a silent n=1 (or a silently missing cell)
    m = summary["measured"]["builtin-heldout"]
    assert m["T=0"]["n"] == 1 and m["T=0"]["incomplete"].startswith("1/3 prompts")
    assert m["T=1"]["n"] == 0 and m["T=1"]["tau"] is None and m["T=1"]["stopped_by_guard"]
    # the reduced-vocabulary heads were trained, saved with their map and measured losslessly
    from specfoundry.runtime import SpeculativeGenerator, load_drafter, load_target
    from specfoundry.runtime.speculators import read_config

    assert read_config(tmp_path / "run" / "speculator")["architecture"]["draft_vocab_size"] == 256
    target = load_target(str(tiny_target_dir))
    drafter = load_drafter(str(tmp_path / "run" / "speculator"), target=target)
    assert drafter.heads.draft_to_target.numel() == 256
    gen = SpeculativeGenerator(target, drafter, adaptive=False)
    kw = dict(prompt="Hello there", max_new_tokens=12, stop_at_eos=False)
    assert gen.generate(**kw).token_ids == gen.generate(speculate=False, **kw).token_ids
    # the CLI's last line names both stopped stages with planned vs done
    assert out_lines[-1] == summary["guard_report"]
    assert out_lines[-1] == ("[train] WARNING: guards stopped 2 stages: data 6/9 examples (data.max_minutes=5), "
                             "evaluation builtin-heldout T=0 1/3 prompts (evaluation.max_minutes=5), "
                             "evaluation builtin-heldout T=1 0/3 prompts (evaluation.max_minutes=5)")

    # a rerun with time to spare continues from the cache and trains on the whole plan (the
    # dataset's cache key covers every prompt done, not a truncated view of the first 5: with 6
    # done and 9 planned both views began with the same 5 and the 6-example dataset came back)
    monkeypatch.undo()
    monkeypatch.setitem(distill.DEFAULT_RESPONSES, "chunk_size", 6)
    monkeypatch.setattr(evaluate, "time", _time)
    args.overwrite = True
    assert run_train(args) == 0
    again = json.loads((tmp_path / "run" / "train_summary.json").read_text())["stages"]
    assert (again["data"]["planned"], again["data"]["done"], again["data"]["stopped_by_guard"]) == (9, 9, False)
    assert capsys.readouterr().out.strip().splitlines()[-1] == "[train] all stages ran as planned"


def test_training_stage_stopped_by_its_guard_or_by_a_fitted_schedule():
    planned = 100
    timed_out = training_stage(planned, {"global_step": 40, "max_steps": 100, "stopped_by_time": True}, 8)
    assert timed_out["stopped_by_guard"] and timed_out["guard"] == "training.max_minutes=8"
    fitted = training_stage(planned, {"global_step": 60, "max_steps": 60, "stopped_by_time": False}, 8)
    assert fitted["stopped_by_guard"] and (fitted["planned"], fitted["done"]) == (100, 60)
    full = training_stage(planned, {"global_step": 100, "max_steps": 100, "stopped_by_time": False}, 8)
    assert not full["stopped_by_guard"]
    line = guard_line({"training": timed_out})
    assert line == "[train] WARNING: guards stopped 1 stage: training 40/100 steps (training.max_minutes=8)"


def test_all_stages_as_planned_and_a_short_prompt_set_is_marked():
    measured = {"mt_bench": {"T=0": {"n": 8, "planned": 8, "tau": 1.5}}}
    ev = evaluation_stage(measured, {"mt_bench": 8}, 2)
    ok = {"data": {"unit": "examples", "planned": 9, "done": 9, "stopped_by_guard": False, "guard": None},
          "training": training_stage(4, {"global_step": 4, "max_steps": 4}, None), "evaluation": ev}
    assert guard_line(ok) == "[train] all stages ran as planned"
    # a set with fewer prompts than evaluation.limit: not the guard, but marked and reported
    short = evaluation_stage({"tiny": {"T=0": {"n": 2, "planned": 2, "tau": 1.2}}}, {"tiny": 8}, None)
    assert short["cells"]["tiny T=0"]["short_of_prompts"] == "the set holds 2 of the 8 prompts asked"
    assert guard_line({"evaluation": short}) == "[train] WARNING: short of plan: evaluation tiny T=0 2/8 prompts (fewer in the set)"
    assert guard_line(None).startswith("[train] WARNING")


def test_evaluation_budget_is_shared_out_over_the_cells(tiny_target_dir, monkeypatch):
    # every prompt costs 31 s of a 120-s budget: without shares the first set took all of it (a
    # slow machine once measured the held-out set and left MT-bench at 0 prompts)
    from specfoundry.runtime import SpeculativeGenerator, load_drafter, load_target
    from specfoundry.train import evaluate

    tiny_target = load_target(str(tiny_target_dir))
    clock = {"t": 0.0}
    monkeypatch.setattr(evaluate, "time", argparse.Namespace(perf_counter=lambda: clock["t"]))
    real = SpeculativeGenerator.generate

    def slow_generate(self, *a, **kw):
        clock["t"] += 31.0
        return real(self, *a, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "generate", slow_generate)
    sets = {"a": ["1 2 3", "4 5 6", "7 8 9", "10 11"], "b": ["12 13", "14 15", "16 17", "18 19"]}
    out = evaluate.evaluate_speculator(tiny_target, load_drafter("ngram", target=tiny_target), sets,
                                       temperatures=(0.0,), max_new_tokens=4, depth=2, baseline=False, max_minutes=2)
    assert (out["a"]["T=0"]["n"], out["b"]["T=0"]["n"]) == (2, 2)
    assert out["a"]["T=0"]["stopped_by_guard"] and out["b"]["T=0"]["stopped_by_guard"]
