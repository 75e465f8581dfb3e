"""A trained EAGLE head's measured runtime default shape (runtime/tune.py): the fastest candidate
is chosen from timed runs, stored in ``training.runtime_shape`` (validated like every checkpoint
field), and used by ``load_drafter`` and the generator whenever the caller names no shape."""

import json
import os
import types

import pytest

from specfoundry.runtime import SpeculativeGenerator, load_drafter, load_target
from specfoundry.runtime import tune
from specfoundry.runtime.drafters.lookup import with_lookup
from specfoundry.runtime.speculators import Eagle3Head, read_config, save_speculator
from specfoundry.runtime.speculators.checkpoint import CheckpointError, runtime_shape_problems, set_runtime_shape
from tiny_models import TINY_PROMPTS, tiny_target_with_smollm2_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

TAU_SHAPE = {"tree": "dynamic", "total_tokens": 8, "top_k": 2, "depth": 3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2):
    d = tiny_target_with_smollm2_tokenizer(tmp_path_factory.mktemp("tiny-target"), smollm2.vocab_size)
    return load_target(str(d)), d


@pytest.fixture
def checkpoint(tmp_path, tiny):
    target, _ = tiny
    head = Eagle3Head.from_target(target, draft_vocab_size=256, seed=0)
    return save_speculator(head, tmp_path / "spec", target, training={"drafter_options": dict(TAU_SHAPE)})


def _stats(seconds, tokens=8):
    return types.SimpleNamespace(stats=types.SimpleNamespace(seconds=seconds, new_tokens=tokens))


class _Timed:
    """A generator whose every request takes ``seconds`` (for the choice rule, not real speed)."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.calls = 0

    def generate(self, **kw):
        self.calls += 1
        return _stats(self.seconds)


def test_a_candidate_faster_on_every_prompt_wins_and_the_budget_stops_new_prompts(monkeypatch, checkpoint, tiny):
    target, _ = tiny
    secs = {"adaptive": 0.8, "chain@2": 0.5, "chain@3": 0.4, "chain@4": 0.4}  # plain: 1.0
    fakes = {c: _Timed(s) for c, s in secs.items()}
    monkeypatch.setattr(tune, "_generator", lambda t, spec, c, lookup: (fakes[c], {"tree": "chain", "depth": int(c[-1]),
                                                                                   "adaptive": False}
                                                                         if c != "adaptive" else {"adaptive": True}))
    import specfoundry.runtime.generator as generator_mod

    monkeypatch.setattr(generator_mod, "SpeculativeGenerator", lambda target: _Timed(1.0))
    five = ["a", "b", "c", "d", "e"]
    shape = tune.measure_runtime_shape(target, checkpoint, five, list(secs), progress=False)
    # faster than the first listed on all 5 prompts (sign test p = 1/32); chain@3 and chain@4 tie at
    # 2.5x: the first listed of them wins
    assert shape["depth"] == 3 and shape["adaptive"] is False and shape["prompts"] == 5
    assert shape["speedups"] == {"adaptive": 1.25, "chain@2": 2.0, "chain@3": 2.5, "chain@4": 2.5}
    assert shape["candidate"] == "chain@3" and tune.chosen_candidate(shape) == "chain@3"
    assert runtime_shape_problems(shape) == []
    assert all(f.calls == 1 + 5 for f in fakes.values())  # one warm-up, then every prompt
    # on 3 prompts the same wins are what chance gives 1 time in 8: the first listed stays
    shape = tune.measure_runtime_shape(target, checkpoint, ["a", "b", "c"], list(secs), progress=False)
    assert shape["adaptive"] is True and shape["candidate"] == "adaptive" and shape["speedups"]["chain@3"] == 2.5

    clock = iter([0.0] + [1e9] * 100)  # the deadline, then always past it
    monkeypatch.setattr(tune, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    shape = tune.measure_runtime_shape(target, checkpoint, ["a", "b", "c"], list(secs), max_minutes=1, progress=False)
    assert shape["prompts"] == 1  # the first prompt is always measured
    with pytest.raises(ValueError, match="at least one prompt"):
        tune.measure_runtime_shape(target, checkpoint, [], progress=False)
    for bad in ("tree@3", "chain@2/4", "tree@3/4"):  # a tree needs N >= K + 2 nodes (K + 1 is a chain)
        with pytest.raises(ValueError, match="expected 'adaptive', 'chain@K' or 'tree@K/N'|N must be"):
            tune.measure_runtime_shape(target, checkpoint, ["a"], [bad], progress=False)


def test_measured_shape_is_stored_and_becomes_the_default(checkpoint, tiny):
    target, _ = tiny
    mode = os.stat(checkpoint / "config.json").st_mode
    weights = (checkpoint / "model.safetensors").read_bytes()
    shape = tune.measure_runtime_shape(target, checkpoint, TINY_PROMPTS[:2], ["adaptive", "chain@2", "tree@2/5"],
                                       max_new_tokens=6, progress=False)
    assert set(shape["speedups"]) == {"adaptive", "chain@2", "tree@2/5"} and all(v > 0 for v in shape["speedups"].values())
    assert shape["prompts"] == 2 and shape["prompt_lookup"] == 2 and shape["dtype"] == str(target.dtype).removeprefix("torch.")
    set_runtime_shape(checkpoint, shape)
    assert read_config(checkpoint)["training"]["runtime_shape"] == shape
    assert read_config(checkpoint)["training"]["drafter_options"] == TAU_SHAPE  # the tau shape is kept
    assert os.stat(checkpoint / "config.json").st_mode == mode
    assert (checkpoint / "model.safetensors").read_bytes() == weights

    # no shape named: the runtime shape and its adaptive setting; a named shape: the tau shape's options
    for forced, want in ((shape, shape), ({"tree": "chain", "depth": 2, "adaptive": False},) * 2,
                         ({**TAU_SHAPE, "adaptive": True},) * 2):
        set_runtime_shape(checkpoint, forced)
        d = load_drafter(str(checkpoint), target=target)
        assert (d.tree, d.depth, d.default_adaptive) == (want["tree"], want["depth"], want["adaptive"])
        gen = SpeculativeGenerator(target, with_lookup(d, 2))
        assert gen.adaptive is want["adaptive"]
        assert SpeculativeGenerator(target, d, adaptive=True).adaptive  # the caller's word wins
    # a measured fixed tree: its depth, node count and fan-out, the controller off, lossless
    tree = {**tune._generator(target, checkpoint, "tree@2/5", 2)[1], "speedups": {"tree@2/5": 1.5}}
    assert tree == {"tree": "dynamic", "depth": 2, "total_tokens": 5, "top_k": 4, "adaptive": False,
                    "speedups": {"tree@2/5": 1.5}} and tune.shape_label(tree) == "tree@2/5"
    set_runtime_shape(checkpoint, tree)
    d = load_drafter(str(checkpoint), target=target)
    assert (d.tree, d.depth, d.total_tokens, d.top_k, d.default_adaptive) == ("dynamic", 2, 5, 4, False)
    gen = SpeculativeGenerator(target, with_lookup(d, 2))
    kw = dict(prompt=TINY_PROMPTS[1], max_new_tokens=12, stop_at_eos=False)
    out = gen.generate(**kw)
    assert out.token_ids == gen.generate(speculate=False, **kw).token_ids
    assert [tune.shape_label(s) for s in ({"adaptive": True}, {"tree": "chain", "depth": 3, "adaptive": False})] == \
        ["adaptive", "chain@3"]
    named = load_drafter(str(checkpoint), target=target, tree="dynamic")
    assert (named.tree, named.depth, named.total_tokens, named.default_adaptive) == ("dynamic", 3, 8, True)
    # lossless whatever the default: the fixed chain's greedy output is the target's
    set_runtime_shape(checkpoint, {"tree": "chain", "depth": 2, "adaptive": False})
    gen = SpeculativeGenerator(target, with_lookup(load_drafter(str(checkpoint), target=target), 2))
    kw = dict(prompt=TINY_PROMPTS[0], max_new_tokens=12, stop_at_eos=False)
    assert gen.generate(**kw).token_ids == gen.generate(speculate=False, **kw).token_ids


@pytest.mark.parametrize("shape, key, problem", [
    ({"tree": "chain", "depth": 3}, "adaptive", "missing"),
    ({"tree": "ring", "depth": 3, "adaptive": False}, "tree", "must be 'dynamic' or 'chain'"),
    ({"tree": "chain", "depth": 0, "adaptive": False}, "depth", "must be in [1, 32]"),
    ({"tree": "chain", "depth": 3, "adaptive": "no"}, "adaptive", "expected bool"),
    ({"tree": "chain", "depth": 3, "adaptive": False, "fastest": True}, "fastest", "unknown key"),
    ({"tree": "chain", "depth": 3, "adaptive": False, "speedups": {"chain@3": "fast"}}, "speedups", "expected numbers"),
])
def test_a_bad_runtime_shape_is_refused_by_name(checkpoint, shape, key, problem):
    problems = runtime_shape_problems(shape)
    assert any(k == key and problem in p for k, p in problems), problems
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["training"]["runtime_shape"] = shape
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"training.runtime_shape.{key}"):
        read_config(checkpoint)
    with pytest.raises(CheckpointError):
        set_runtime_shape(checkpoint, {"tree": "chain", "depth": 2, "adaptive": False})  # reads (validates) first


def test_tune_shape_cli(checkpoint, tiny, capsys):
    from specfoundry.runtime.cli import main

    _, target_dir = tiny
    before = (checkpoint / "config.json").read_text()
    assert main(["tune-shape", "--speculator", str(checkpoint), "--target", str(target_dir), "--limit", "2",
                 "--shapes", "chain@2,chain@3", "--max-new-tokens", "4", "--dtype", "float32", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    shape, calibrated = printed["runtime_shape"], printed["draft_temperature"]
    assert set(shape["speedups"]) == {"chain@2", "chain@3"} and shape["prompts"] == 2
    assert calibrated["temperatures"] == [0.7, 1.0] and calibrated["prompts"] == 2
    assert (checkpoint / "config.json").read_text() == before  # --dry-run writes nothing
    assert main(["tune-shape", "--speculator", str(checkpoint), "--target", str(target_dir), "--limit", "1",
                 "--shapes", "chain@2", "--max-new-tokens", "4", "--dtype", "float32", "--draft-temperatures", "0.8"]) == 0
    training = read_config(checkpoint)["training"]
    assert training["runtime_shape"]["depth"] == 2 and training["draft_temperature"]["temperatures"] == [0.8]
    assert json.loads(capsys.readouterr().out)["draft_temperature"]["scale"] == training["draft_temperature"]["scale"]
    assert main(["tune-shape", "--speculator", str(checkpoint), "--target", str(target_dir), "--limit", "1",
                 "--shapes", "chain@2", "--max-new-tokens", "4", "--dtype", "float32", "--draft-temperatures", "0,1"]) == 2
    assert "--draft-temperatures must be > 0" in capsys.readouterr().err
    stored = read_config(checkpoint)["training"]["runtime_shape"]
    assert main(["tune-shape", "--speculator", str(checkpoint), "--target", str(target_dir), "--limit", "1",
                 "--shapes", "", "--max-new-tokens", "4", "--dtype", "float32"]) == 0  # the draft temperature alone
    assert json.loads(capsys.readouterr().out)["runtime_shape"] is None
    training = read_config(checkpoint)["training"]
    assert training["runtime_shape"] == stored and training["draft_temperature"]["temperatures"] == [0.7, 1.0]
    assert main(["tune-shape", "--speculator", str(checkpoint), "--shapes", "", "--draft-temperatures", ""]) == 2
    assert "nothing to measure" in capsys.readouterr().err
    assert main(["tune-shape", "--speculator", str(checkpoint), "--target", str(target_dir), "--shapes", "tree@2"]) == 2
    assert "expected 'adaptive', 'chain@K' or 'tree@K/N'" in capsys.readouterr().err


def test_recipe_default_candidates_are_the_runtimes():
    """The recipe schema writes the default candidates out (it must not import the runtime for a dry
    run): they are the runtime's, and every one parses."""
    from specfoundry.runtime.adaptive import RUNTIME_SHAPE_CANDIDATES, parse_shape_candidate
    from specfoundry.train.recipe_schema import EvaluationConfig

    assert tuple(EvaluationConfig().runtime_shapes) == RUNTIME_SHAPE_CANDIDATES == tune.DEFAULT_CANDIDATES
    assert [parse_shape_candidate(c)[0] for c in RUNTIME_SHAPE_CANDIDATES] == ["tree", "adaptive", "chain", "chain",
                                                                                "tree", "tree"]



def test_no_shape_beating_plain_is_stored_under_the_controller(monkeypatch, checkpoint, tiny):
    # every candidate slower than plain (a fast CPU, a weak head): a fixed shape would slow every
    # request, so the fastest becomes the controller's largest shape (it steps plainly where drafting
    # does not pay); one candidate at >= 1.0x keeps its fixed shape
    target, _ = tiny
    import specfoundry.runtime.generator as generator_mod

    monkeypatch.setattr(generator_mod, "SpeculativeGenerator", lambda target: _Timed(1.0))
    for secs, adaptive in (({"chain@2": 1.05, "adaptive": 1.3, "chain@3": 1.2}, True),
                           ({"chain@2": 0.95, "adaptive": 1.3, "chain@3": 1.2}, False)):
        fakes = {c: _Timed(s) for c, s in secs.items()}
        monkeypatch.setattr(tune, "_generator", lambda t, spec, c, lookup, fakes=fakes: (
            fakes[c], {"tree": "chain", "depth": int(c[-1]), "adaptive": False} if c != "adaptive" else {"adaptive": True}))
        shape = tune.measure_runtime_shape(target, checkpoint, ["a", "b"], list(secs), progress=False)
        assert shape["depth"] == 2 and shape["adaptive"] is adaptive and runtime_shape_problems(shape) == []
        assert tune.shape_label(shape) == ("adaptive (up to chain@2)" if adaptive else "chain@2")
        assert tune.chosen_candidate(shape) == "chain@2"


def test_a_challenger_replaces_the_first_shape_only_on_evidence():
    # per-prompt speed-ups (the same prompts for every candidate): a higher median is not enough
    # when the wins are few (a noisy machine), the first listed stays; wins on every one of 6 prompts
    # (p = 1/64) replace it; of several such, the highest median
    first = [1.20, 1.25, 1.10, 1.30, 1.22, 1.18]
    noisy = [1.40, 1.35, 1.05, 1.00, 1.41, 1.15]  # median 1.275 > 1.21, faster on 3 of 6 (p = 0.66)
    assert tune.choose_candidate({"tree@2/4": first, "adaptive": noisy}) == "tree@2/4"
    five = [1.30, 1.30, 1.20, 1.20, 1.30, 1.00]  # faster on 5 of 6: p = 7/64 > 0.05
    assert tune.choose_candidate({"tree@2/4": first, "chain@2": five}) == "tree@2/4"
    every = [x + 0.01 for x in first]
    better = [x + 0.05 for x in first]
    assert tune.choose_candidate({"tree@2/4": first, "chain@2": every, "chain@3": better, "adaptive": noisy}) == "chain@3"
    assert tune.choose_candidate({"tree@2/4": first}) == "tree@2/4"
    slower = [x - 0.01 for x in first]  # a lower median never replaces it, whatever the count
    assert tune.choose_candidate({"tree@2/4": first, "chain@2": slower}) == "tree@2/4"
    assert tune.sign_test_p(6, 6) == 1 / 64 and tune.sign_test_p(5, 6) == 7 / 64 and tune.sign_test_p(0, 6) == 1.0


def test_the_bench_runtime_method_is_what_generate_loads(checkpoint, tiny):
    from specfoundry.bench.methods import MethodFactory

    target, _ = tiny
    f = MethodFactory(target, [checkpoint])
    m = f.build("eagle3:runtime")  # no measured shape stored yet: its tau shape under the controller, lookup first
    assert m.name == "eagle3:lookup-adaptive@3" and "the run's runtime default" in m.label
    set_runtime_shape(checkpoint, {"tree": "dynamic", "depth": 2, "total_tokens": 4, "top_k": 3, "adaptive": False})
    f = MethodFactory(target, [checkpoint])
    assert f.build("eagle3:runtime").name == "eagle3:lookup-tree@2/4"
    # --methods auto: every default spec of a trained head builds (a lookup tree needs a size: the run's own)
    names = [f.build(s).name for s in f.default_specs()]
    assert "eagle3:lookup-tree@2/4" in names and "eagle3:lookup-adaptive@3" in names and len(set(names)) == len(names)
    set_runtime_shape(checkpoint, {"tree": "chain", "depth": 2, "adaptive": False})
    assert MethodFactory(target, [checkpoint]).build("eagle3:runtime").name == "eagle3:lookup@2"
    set_runtime_shape(checkpoint, {"tree": "dynamic", "adaptive": False})  # no size stored: the drafter's defaults
    assert MethodFactory(target, [checkpoint]).build("eagle3:runtime").name == "eagle3:lookup-tree@5/32"
    with pytest.raises(ValueError, match="runtime takes no depth"):
        f.build("eagle3:runtime@2")
    with pytest.raises(ValueError, match="needs a trained run"):
        MethodFactory(target).build("eagle3:runtime")
