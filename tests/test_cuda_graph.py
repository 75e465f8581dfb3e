"""The static-shape engine step (runtime/cuda_graph.py): on a CPU it runs eagerly, exactly the
function a CUDA graph would capture, and must match the engine's ordinary forward; the capture
and replay themselves are checked by the gpu-marked test (``make test-gpu``)."""

import pytest
import torch

from specfoundry.runtime.cuda_graph import BUCKETS, GraphedStep, GraphedTarget, bucket_for
from specfoundry.runtime.drafters.draft import DraftModelDrafter
from specfoundry.runtime.generator import SpeculativeGenerator
from specfoundry.runtime.tree import ancestor_matrix, path_to, tree_depths
from tiny_models import perturbed_copy, record_host_reads, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")
FEATS = (0, 1, 2)  # every layer's input and the final normed state of a 2-layer model


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=64, layers=2)


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return torch.tensor([parents])


def prefilled(target, prompt: torch.Tensor, capacity: int):
    cache = target.new_cache(capacity=capacity)
    target.forward(prompt, cache)
    cache.commit()
    return cache


def run_parity(target, ref_cache, cache, step, sizes, gen, device="cpu", tol=1e-10):
    """Drive the ordinary forward and ``step`` with the same random trees (committing the same
    random accepted path) and require equal logits and features at every step."""
    for n in sizes:
        tokens = torch.randint(0, 64, (1, n), generator=gen).to(device)
        parents = random_tree(n, gen)
        mask = ancestor_matrix(parents).to(device) if n > 1 else None
        positions = (ref_cache.length + tree_depths(parents)).to(device)
        ref = target.forward(tokens, ref_cache, positions, mask, feature_layers=step.feature_layers)
        out = step.step(tokens, positions, mask)
        assert out.logits.shape == ref.logits.shape == (1, n, 64)
        torch.testing.assert_close(out.logits, ref.logits, atol=tol, rtol=tol)
        if step.feature_layers:
            torch.testing.assert_close(out.features, ref.features, atol=tol, rtol=tol)
        path = path_to(parents, torch.randint(0, n, (1,), generator=gen))[0]
        keep = path[path >= 0]
        ref_cache.commit(keep.to(device))
        cache.commit(keep.to(device))
        assert cache.length == ref_cache.length
    L = cache.length
    torch.testing.assert_close(cache.kv[..., :L, :], ref_cache.kv[..., :L, :], atol=tol, rtol=tol)


# -- (a) parity with the engine's ordinary forward -------------------------------------------------
def test_plain_steps_match_the_engine_forward(target):
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (1, 9), generator=gen)
    ref_cache, cache = prefilled(target, prompt, 128), prefilled(target, prompt, 128)
    step = GraphedStep(target, cache, FEATS)
    assert not step.capture  # a CPU cache: the static function runs eagerly
    run_parity(target, ref_cache, cache, step, [1] * 30, gen)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trees_padded_to_buckets_match_the_engine_forward(target, seed):
    gen = torch.Generator().manual_seed(10 + seed)
    prompt = torch.randint(0, 64, (1, 5 + 7 * seed), generator=gen)
    ref_cache, cache = prefilled(target, prompt, 400), prefilled(target, prompt, 400)
    step = GraphedStep(target, cache, FEATS if seed else ())
    sizes = [1, 2, 3, 5, 8, 1, 13, 16, 17, 31, 33, 64, 4, 6, 1, 40, 2, 9, 25, 64, 7, 1, 12, 3]
    run_parity(target, ref_cache, cache, step, sizes, gen)


def test_batch_of_two_with_a_shared_tree(target):
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 64, (2, 6), generator=gen)
    ref_cache, cache = prefilled(target, prompt, 64), prefilled(target, prompt, 64)
    step = GraphedStep(target, cache)
    for n in (3, 1, 6):
        tokens = torch.randint(0, 64, (2, n), generator=gen)
        mask = ancestor_matrix(random_tree(n, gen))
        ref = target.forward(tokens, ref_cache, tree_mask=mask)
        out = step.step(tokens, tree_mask=mask)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-10, rtol=1e-10)
        ref_cache.commit(torch.tensor([0]))
        cache.commit(torch.tensor([0]))


def test_a_regrown_cache_or_edited_weights_rebuild_the_step():
    t = tiny_llama(vocab=64, layers=2)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 64, (1, 8), generator=gen)
    ref_cache, cache = prefilled(t, prompt, 16), prefilled(t, prompt, 16)
    step = GraphedStep(t, cache)
    run_parity(t, ref_cache, cache, step, [4, 1], gen)
    cache.reserve(40)  # reallocates the storage the step was built on
    ref_cache.reserve(40)
    with torch.no_grad():
        t.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    run_parity(t, ref_cache, cache, step, [16, 1, 2], gen)
    assert step.kv is cache.kv and step.engine is t._engine()


# -- (b) decoding -----------------------------------------------------------------------------------
def test_greedy_loop_on_the_static_step_matches_the_generator(target):
    prompt = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(7))
    N = 40
    want = SpeculativeGenerator(target, None).generate(prompt_ids=prompt, max_new_tokens=N,
                                                       stop_at_eos=False).token_ids
    cache = prefilled(target, prompt[:, :-1], prompt.shape[1] + N)
    step = GraphedStep(target, cache)
    ids = prompt
    for _ in range(N):
        logits = step.step(ids[:, -1:]).logits
        cache.commit()
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, prompt.shape[1]:].tolist() == want


def test_generator_on_a_graphed_target_is_lossless(target):
    prompt = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(8))
    want = SpeculativeGenerator(target, None).generate(prompt_ids=prompt, max_new_tokens=30,
                                                       stop_at_eos=False).token_ids
    graphed = GraphedTarget(target)
    drafter = DraftModelDrafter(perturbed_copy(target, 0.05), target)
    gen = SpeculativeGenerator(graphed, drafter, max_depth=4, adaptive=False)
    for _ in range(2):  # the second request reuses the cache (and, on CUDA, the graphs)
        out = gen.generate(prompt_ids=prompt, max_new_tokens=30, stop_at_eos=False)
        assert out.token_ids == want
        assert out.stats.speculative_steps > 0
    assert list(graphed.steps) == [()]
    plain = SpeculativeGenerator(graphed, None).generate(prompt_ids=prompt, max_new_tokens=30, stop_at_eos=False)
    assert plain.token_ids == want


# -- (c) buckets and limits -------------------------------------------------------------------------
def test_bucket_selection():
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64)
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 9, 33, 63, 64)] == [1, 2, 4, 4, 8, 16, 64, 64, 64]
    with pytest.raises(ValueError, match="exceed the largest graph bucket"):
        bucket_for(65)
    with pytest.raises(ValueError, match="at least one node"):
        bucket_for(0)
    assert bucket_for(3, (1, 8)) == 8


def test_padding_and_limits(target):
    cache = prefilled(target, torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(2)), 66)
    step = GraphedStep(target, cache)
    out = step.step(torch.tensor([[5, 6, 7]]))  # padded to 4, three rows back
    assert out.logits.shape == (1, 3, 64) and cache._pending == 3
    with pytest.raises(RuntimeError, match="commit or roll back"):
        step.step(torch.tensor([[1]]))
    cache.rollback()
    with pytest.raises(ValueError, match="largest graph bucket"):
        step.step(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed the capacity"):
        step.step(torch.zeros(1, 33, dtype=torch.long))  # 4 cached + bucket 64 > 66
    with pytest.raises(ValueError, match="batch"):
        step.step(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="CUDA"):
        GraphedStep(target, cache, capture=True)


def test_the_static_function_reads_nothing_back_to_the_host(target, monkeypatch):
    """What a CUDA graph cannot capture: a device value read on the host (item, bool, int,
    tolist, nonzero). The captured function must not do it for any bucket."""
    cache = prefilled(target, torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(6)), 80)
    step = GraphedStep(target, cache, FEATS)
    step.step(torch.tensor([[1, 2, 3]]))  # fills the buffers of bucket 4 (the host side may sync)
    cache.rollback()
    reads = record_host_reads(monkeypatch)
    with torch.inference_mode():
        for n in BUCKETS:
            out = step.static_step(n)
            assert out.logits.shape == (1, n, 64) and out.features.shape[:3] == (1, n, len(FEATS))
    monkeypatch.undo()
    assert reads == []


# -- (d) capture and replay (CUDA only) -------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_cuda_graphs_replay_what_the_eager_step_computes():
    t = tiny_llama(vocab=64, layers=2)
    t.model.to("cuda")
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 64, (1, 9), generator=gen).cuda()
    sizes = [1, 1, 3, 4, 1, 8, 5, 16, 2, 1, 3, 33, 64, 1]
    results = {}
    for capture in (False, True):
        g = torch.Generator().manual_seed(5)
        ref_cache, cache = prefilled(t, prompt, 256), prefilled(t, prompt, 256)
        step = GraphedStep(t, cache, FEATS, capture=capture)
        assert step.capture is capture
        run_parity(t, ref_cache, cache, step, sizes, g, device="cuda", tol=1e-9)
        results[capture] = cache.kv[..., : cache.length, :].clone()
        assert step.captures == (len({bucket_for(n) for n in sizes}) if capture else 0)
    torch.testing.assert_close(results[True], results[False], atol=1e-9, rtol=1e-9)
    prompt_ids = prompt[0].tolist()
    want = SpeculativeGenerator(t, None).generate(prompt_ids=prompt_ids, max_new_tokens=20, stop_at_eos=False)
    draft = perturbed_copy(t, 0.05)  # built on the CPU
    draft.model.to("cuda")
    drafter = DraftModelDrafter(draft, t)
    got = SpeculativeGenerator(GraphedTarget(t), drafter, max_depth=4, adaptive=False).generate(
        prompt_ids=prompt_ids, max_new_tokens=20, stop_at_eos=False)
    assert got.token_ids == want.token_ids


# -- (e) the generator graphs CUDA engine targets by default ------------------------------------------
def test_the_generator_graphs_an_engine_target_on_cuda_by_default(monkeypatch):
    """An engine target on CUDA is wrapped in a GraphedTarget unless ``cuda_graphs=False``; on the
    CPU nothing changes and ``cuda_graphs=True`` is refused. Here "on CUDA" is faked, so the
    wrapper runs its static step eagerly (what would be captured), and speculative greedy output
    through it equals plain decoding of the unwrapped target."""
    from specfoundry.runtime import generator as G
    from specfoundry.runtime import load_drafter

    t = tiny_llama(vocab=64, layers=2)
    assert not isinstance(SpeculativeGenerator(t).target, GraphedTarget)
    with pytest.raises(ValueError, match="needs an engine target on CUDA"):
        SpeculativeGenerator(t, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        SpeculativeGenerator(t, cuda_graphs="yes")
    prompt = [5, 9, 3, 5, 9, 3, 7]
    want = SpeculativeGenerator(t).generate(prompt_ids=prompt, max_new_tokens=24, speculate=False,
                                            stop_at_eos=False).token_ids
    monkeypatch.setattr(G, "_runs_on_cuda", lambda target: True)
    assert not isinstance(SpeculativeGenerator(t, cuda_graphs=False).target, GraphedTarget)
    for drafter in (load_drafter("ngram", target=t), load_drafter("eagle3", target=t)):
        gen = SpeculativeGenerator(t, drafter, max_depth=3, adaptive=False)
        assert isinstance(gen.target, GraphedTarget) and gen.target.target is t
        for _ in range(2):  # the second request reuses the wrapper's cache and steps
            assert gen.generate(prompt_ids=prompt, max_new_tokens=24, stop_at_eos=False).token_ids == want
        assert gen.target.steps  # the static steps ran
