"""Hardening of the runtime (issue 16): inputs validated at the boundary with one sentence,
bounded draft shapes (and bounded adaptive-controller work, counted), the context length, and a
generator shared between threads."""

import threading

import pytest
import torch

from tiny_models import tiny_llama
from specfoundry.runtime import SpeculativeGenerator
from specfoundry.runtime.adaptive import MAX_DRAFT_DEPTH, MAX_DRAFT_NODES, AdaptiveController
from specfoundry.runtime.drafters import load_drafter
from specfoundry.runtime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(3, dtype=torch.float32)


@pytest.fixture(scope="module")
def gen(target):
    return SpeculativeGenerator(target, load_drafter("ngram", target=target))


PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0.0}, "top_p must be > 0"),
    ({"top_p": 1.5}, "top_p must be <= 1"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_k": 0}, "top_k must be >= 1"),
    ({"max_new_tokens": 4.0}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": "8"}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": "0"}, "seed must be an integer"),
    ({"seed": -1}, "seed must be in"),
    ({"speculate": "no"}, "speculate must be True or False"),
    ({"context_overflow": "drop"}, "context_overflow must be one of"),
])
def test_bad_sampling_and_request_values_are_one_sentence(gen, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(prompt_ids=PROMPT, **{"max_new_tokens": 4, "temperature": 1.0, **kwargs})
    with pytest.raises(ValueError, match=message):  # streams check their arguments at the call, too
        gen.stream(prompt_ids=PROMPT, **{"max_new_tokens": 4, "temperature": 1.0, **kwargs})


def test_nan_temperature_is_refused_by_sampling_params():
    with pytest.raises(ValueError, match="temperature must be a finite number, got nan"):
        SamplingParams(float("nan"))


@pytest.mark.parametrize("prompt_ids, message", [
    ([1, 2, 64], r"outside the vocabulary \[0, 64\)"),
    ([1, -3], "outside the vocabulary"),
    ([1, 2.0], "prompt_ids must be integers"),
    ([1, True], "prompt_ids must be integers"),
    (torch.tensor([1.0, 2.0]), "integer token ids"),
    (torch.ones(2, 3, dtype=torch.long), "one sequence"),
    ("1 2 3", "list of ints or an integer tensor"),
    ([], "the prompt is empty"),
])
def test_bad_prompt_ids_are_refused(gen, prompt_ids, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(prompt_ids=prompt_ids, max_new_tokens=2)


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": 42}], r"messages\[0\]\['content'\] must be a string, got int"),
    ([{"role": "user", "content": ["a", "b"]}], "must be a string, got list"),
    ([{"role": "user", "content": None}], "must be a string, got NoneType"),
    ([{"role": 1, "content": "hi"}], r"\['role'\] must be a non-empty string"),
    ([{"content": "hi"}], r"messages\[0\] must be a"),
    ([], "non-empty list"),
    ("hi", "non-empty list"),
])
def test_bad_messages_are_refused(gen, messages, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(messages=messages, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt must be a string"):
        gen.generate(prompt=123, max_new_tokens=2)


def test_prompt_plus_max_new_tokens_beyond_the_context_is_an_error(gen, target):
    limit = target.model.config.max_position_embeddings  # 512
    long_prompt = [i % 60 + 1 for i in range(limit - 3)]
    with pytest.raises(ValueError, match=r"exceeds the target's context of 512 tokens"):
        gen.generate(prompt_ids=long_prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the target's context"):
        gen.generate(prompt_ids=[1] * (limit + 10), max_new_tokens=1)
    # truncation only when asked: the prompt's last tokens, the same output as given them directly
    out = gen.generate(prompt_ids=long_prompt, max_new_tokens=6, context_overflow="truncate_prompt")
    assert len(out.prompt_ids) == limit - 6 and out.prompt_ids == long_prompt[-(limit - 6):]
    ref = gen.generate(prompt_ids=long_prompt[-(limit - 6):], max_new_tokens=6)
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 6
    # right at the limit: allowed, and no draft node is placed past the last position
    out = gen.generate(prompt_ids=long_prompt[: limit - 6], max_new_tokens=6)
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("kwargs, message", [
    ({"max_depth": 10**6}, f"max_depth must be in \\[1, {MAX_DRAFT_DEPTH}\\]"),
    ({"max_depth": 0}, "max_depth must be in"),
    ({"max_depth": -2}, "max_depth must be in"),
    ({"max_nodes": 0}, f"max_nodes must be in \\[2, {MAX_DRAFT_NODES}\\]"),
    ({"max_nodes": 10**6}, "max_nodes must be in"),
    ({"max_depth": 2.5}, "max_depth must be an integer"),
])
def test_draft_shape_bounds_in_the_api(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeGenerator(target, load_drafter("ngram", target=target), **kwargs)


@pytest.mark.parametrize("source, options, message", [
    ("eagle3", {"depth": 10**6}, "depth must be in"),
    ("eagle3", {"depth": -2}, "depth must be in"),
    ("eagle3", {"total_tokens": 0}, "total_tokens must be in"),
    ("eagle3", {"total_tokens": 10**6}, "total_tokens must be in"),
    ("eagle3", {"top_k": 10**4}, "top_k must be in"),
    ("ngram", {"depth": 10**6}, "depth must be in"),
    ("ngram", {"depth": 0}, "depth must be in"),
    ("medusa", {"choices": [[0]] * (MAX_DRAFT_NODES + 1)}, "more than the limit"),
])
def test_draft_shape_bounds_in_drafter_options(target, source, options, message):
    with pytest.raises(ValueError, match=message):
        load_drafter(source, target=target, **options)


@pytest.mark.parametrize("flags, message", [
    (["--depth", "1000000"], "--depth must be in"),
    (["--depth", "-2"], "--depth must be in"),
    (["--nodes", "0"], "--nodes must be in"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--top-p", "2"], "top_p must be <= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--device", "cuda:7" if torch.cuda.is_available() else "cuda"], "--device cuda"),
    (["--device", "toaster"], "not a device name"),
])
def test_generate_cli_refuses_bad_flags_before_loading_anything(flags, message, capsys, monkeypatch):
    from specfoundry.runtime import cli

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the flags were checked")

    monkeypatch.setattr("specfoundry.runtime.models.load_target", no_load)
    assert cli.main(["generate", "--prompt", "hi", *flags]) == 2
    assert message in capsys.readouterr().err


def test_adaptive_controller_work_per_step_is_bounded(target):
    """Counted, not timed: the controller's unit operations per step at the largest allowed shape
    stay under a fixed bound, and do not grow with the steps and sizes it has measured."""
    g = SpeculativeGenerator(target, load_drafter("eagle3", target=target, total_tokens=MAX_DRAFT_NODES,
                                                  depth=MAX_DRAFT_DEPTH),
                             max_depth=MAX_DRAFT_DEPTH, max_nodes=MAX_DRAFT_NODES)
    shapes = g._shapes(MAX_DRAFT_DEPTH)
    ctl = AdaptiveController(MAX_DRAFT_DEPTH, cost_curve={1: 1.0, 8: 1.5, 64: 4.0, 256: 12.0})
    bound = 8 * MAX_DRAFT_DEPTH ** 2 + 4 * MAX_DRAFT_NODES
    worst = 0
    gen = torch.Generator().manual_seed(0)
    for size in range(1, MAX_DRAFT_NODES + 1, 3):  # measurements at many forward sizes from the start
        ctl.record((1, 2), 1, int(size % 2), size, 1e-3 * (1 + size / 32), 1e-4)
    for step in range(400):
        shape = ctl.choose(shapes)
        worst = max(worst, ctl.work)
        k, n = shape
        size = int(torch.randint(1, n + 1, (1,), generator=gen)) if k else 1  # every forward size shows up
        ctl.record(shape, k, int(torch.randint(0, k + 1, (1,), generator=gen)), size, 1e-3 * (1 + size / 32),
                   1e-4 * k)
    assert len(ctl.verify_cost) > 50  # many sizes measured
    assert 0 < worst <= bound, (worst, bound)


def _outputs(g, prompts, **kw):
    return [g.generate(prompt_ids=p, max_new_tokens=12, **kw).token_ids for p in prompts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_generator_shared_by_four_threads_gives_the_solo_outputs(target, temperature):
    drafter = load_drafter("eagle3", target=target)
    # T=1: a fixed draft shape, so the random draws do not depend on timing-driven choices
    g = SpeculativeGenerator(target, drafter, adaptive=temperature == 0.0)
    prompts = [[(7 * i + j) % 60 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    solo = _outputs(g, prompts, temperature=temperature, seed=11)
    results, errors = [None] * 4, []
    start = threading.Barrier(4)

    def work(i):
        try:
            start.wait()
            results[i] = [g.generate(prompt_ids=prompts[i], max_new_tokens=12, temperature=temperature,
                                     seed=11).token_ids for _ in range(3)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        assert results[i] == [solo[i]] * 3


def test_a_stream_holds_the_target_and_the_same_thread_cannot_reenter(gen):
    s = gen.stream(prompt_ids=PROMPT, max_new_tokens=6)
    next(s)
    with pytest.raises(RuntimeError, match="already running a request"):
        gen.generate(prompt_ids=PROMPT, max_new_tokens=2)
    s.close()  # closing releases the target
    assert len(gen.generate(prompt_ids=PROMPT, max_new_tokens=2).token_ids) == 2


def test_a_drafter_that_is_not_one_is_refused(target):
    with pytest.raises(ValueError, match="drafter must be a Drafter"):
        SpeculativeGenerator(target, "ngram")


def test_max_new_tokens_is_bounded_when_the_target_states_no_context(target, monkeypatch):
    g = SpeculativeGenerator(target)
    monkeypatch.setattr(type(g), "context_length", property(lambda self: None))
    with pytest.raises(ValueError, match="states no context length"):
        g.generate(prompt_ids=PROMPT, max_new_tokens=10**9)


def test_two_generators_sharing_a_target_share_its_lock(target):
    a = SpeculativeGenerator(target, load_drafter("ngram", target=target))
    b = SpeculativeGenerator(target, load_drafter("eagle3", target=target))
    assert a._lock is b._lock
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    solo = [a.generate(prompt_ids=prompts[0], max_new_tokens=10).token_ids,
            b.generate(prompt_ids=prompts[1], max_new_tokens=10).token_ids]
    out, errors = [None, None], []

    def work(i, g):
        try:
            out[i] = [g.generate(prompt_ids=prompts[i], max_new_tokens=10).token_ids for _ in range(3)]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(0, a)), threading.Thread(target=work, args=(1, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and out == [[solo[0]] * 3, [solo[1]] * 3]


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_tiny_positive_temperature_samples_the_argmax_instead_of_nan(gen, temperature):
    from specfoundry.runtime.sampling import probs_from_logits

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 5
    p = probs_from_logits(logits, SamplingParams(temperature))
    assert torch.isfinite(p).all() and torch.equal(p.argmax(-1), logits.argmax(-1))
    greedy = gen.generate(prompt_ids=PROMPT, max_new_tokens=6).token_ids
    assert gen.generate(prompt_ids=PROMPT, max_new_tokens=6, temperature=temperature).token_ids == greedy


def test_a_drafter_built_for_another_target_is_refused(target):
    other = tiny_llama(4, dtype=torch.float32)  # same shapes, other weights
    with pytest.raises(ValueError, match="built for target 'tiny-4'.*fingerprint"):
        SpeculativeGenerator(target, load_drafter("eagle3", target=other))
    with pytest.raises(ValueError, match="beyond the heads' vocabulary"):
        load_drafter("medusa", target=target, choices=[[0], [64]])


@pytest.mark.parametrize("source", ["ngram", "eagle3", "medusa"])
def test_an_unknown_drafter_option_is_one_sentence(target, source):
    with pytest.raises(ValueError, match=f"unknown option 'depht' for the {source} drafter"):
        load_drafter(source, target=target, depht=3)


def test_adaptive_controller_ignores_nan_costs():
    ctl = AdaptiveController(4, cost_curve={1: 1.0, 4: float("nan"), 8: -2.0, 16: 3.0})
    assert ctl.cost_curve == {1: 1.0, 16: 3.0}
    shapes = [(1, 2), (2, 3), (3, 4), (4, 5)]
    for _ in range(12):
        s = ctl.choose(shapes)
        ctl.record(s, s[0], s[0], s[1], float("nan"), float("-inf"))
    assert all(e.value is not None and e.value > 0 for e in ctl.verify_cost.values())
    rates = [ctl.expected_rate(s) for s in shapes]
    assert all(r is not None and r == r for r in rates)  # no NaN rate
