"""The static-shape EAGLE drafting (runtime/cuda_graph_draft.py): on a CPU the functions a CUDA
graph would capture run eagerly and must propose exactly the eager drafter's chains and trees; the
capture itself is checked by the gpu-marked test (``make test-gpu``)."""

import pytest
import torch

from specfoundry.runtime import SpeculativeGenerator, load_drafter
from specfoundry.runtime.cuda_graph_draft import GraphedEagleDraft, stable_topk
from specfoundry.runtime.drafters.eagle import topk_first
from tiny_models import record_host_reads, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")
SHAPES = [("eagle3", dict(tree="chain", depth=4)), ("eagle3", dict(top_k=3, depth=4, total_tokens=10)), ("eagle3", dict(top_k=4, depth=5, total_tokens=12)),
          ("eagle", dict(top_k=2, depth=3, total_tokens=6)), ("eagle", dict(tree="chain", depth=2))]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=64, layers=2)


def recorded(drafter):
    """``drafter`` with every proposal kept in ``drafter.seen``."""
    drafter.seen = []
    propose = drafter.propose

    def spy(ctx):
        d = propose(ctx)
        drafter.seen.append((d.tokens.tolist(), d.parents.tolist()))
        return d

    drafter.propose = spy
    return drafter


@pytest.mark.parametrize("kind,opts", SHAPES)
def test_graphed_drafts_equal_the_eager_drafts(target, kind, opts):
    gen = torch.Generator().manual_seed(4)
    eager = recorded(load_drafter(kind, target=target, **opts))
    graphed = recorded(load_drafter(kind, target=target, **opts))
    runs = []
    for d in (eager, graphed):
        g = SpeculativeGenerator(target, d, adaptive=False)
        if d is graphed:
            d.use_cuda_graphs(True, capture=False)
            assert d._graphs is False
        outs = []
        for length in (40, 7):  # a prompt past the largest queue bucket (the eager step), then a short one
            prompt = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
            outs.append(g.generate(prompt_ids=prompt, max_new_tokens=30, stop_at_eos=False).token_ids)
        runs.append(outs)
    plain = SpeculativeGenerator(target, None)
    for length, out in zip((40, 7), runs[1]):
        prompt = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
        assert out == plain.generate(prompt_ids=prompt, max_new_tokens=30, stop_at_eos=False).token_ids
    assert runs[0] == runs[1]
    assert len(graphed.seen) == len(eager.seen) > 10
    assert graphed.seen == eager.seen  # the same chains and trees, node for node
    assert graphed._graphed is not None and graphed._graphed.cache is graphed.cache
    assert graphed._graphed.runs >= len(graphed.seen) - 2  # every proposal but the prompts' first ran static
    del gen


def test_adaptive_shapes_and_a_reused_cache(target):
    """The adaptive controller changes depth and node count per step: every shape gets its own
    static function; a second request reuses the head cache (so CUDA graphs would be captured once)."""
    d = recorded(load_drafter("eagle3", target=target, top_k=2, depth=4, total_tokens=8))
    g = SpeculativeGenerator(target, d, adaptive=True)
    d.use_cuda_graphs(True, capture=False)
    plain = SpeculativeGenerator(target, None)
    caches = []
    for seed in range(3):
        prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
        out = g.generate(prompt_ids=prompt, max_new_tokens=40, stop_at_eos=False)
        assert out.token_ids == plain.generate(prompt_ids=prompt, max_new_tokens=40, stop_at_eos=False).token_ids
        caches.append(d.cache)
    assert caches[0] is caches[1] is caches[2]
    d.use_cuda_graphs(False)
    assert d._graphed is None


def test_a_regrown_head_cache_rebuilds_the_buffers(target):
    d = load_drafter("eagle3", target=target, tree="chain", depth=3)
    g = SpeculativeGenerator(target, d, adaptive=False)
    d.use_cuda_graphs(True, capture=False)
    plain = SpeculativeGenerator(target, None)
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(9))
    # capacity 2*4+256 = 264 entries; 300 new tokens need more: reserve regrows, the static buffers follow
    out = g.generate(prompt_ids=prompt, max_new_tokens=300, stop_at_eos=False)
    assert out.token_ids == plain.generate(prompt_ids=prompt, max_new_tokens=300, stop_at_eos=False).token_ids
    assert d.cache.capacity > 264 and d._graphed.kv is d.cache.kv
    assert d._graphed.cos.shape[0] == d.cache.capacity


def test_stable_topk_is_topk_first():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randint(0, 4, (3, 9), generator=g).float()  # many ties
        for k in (1, 3, 9):
            assert [t.tolist() for t in stable_topk(x, k)] == [t.tolist() for t in topk_first(x, k)]


def test_the_static_functions_read_nothing_back_to_the_host(target, monkeypatch):
    """What a CUDA graph cannot capture: a device value read on the host."""
    d = load_drafter("eagle3", target=target, top_k=3, depth=4, total_tokens=10)
    g = SpeculativeGenerator(target, d, adaptive=False)
    d.use_cuda_graphs(True, capture=False)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    g.generate(prompt_ids=prompt, max_new_tokens=6, stop_at_eos=False)
    gd = d._graphed
    assert isinstance(gd, GraphedEagleDraft) and gd.queue_inputs
    reads = record_host_reads(monkeypatch)
    with torch.inference_mode():
        for n in gd.queue_inputs:
            gd.static_queue(n)
        assert gd.static_chain(4).shape == (4,)
        tok, par, keep = gd.static_tree(4, 3, 9)
    monkeypatch.undo()
    assert reads == []
    assert tok.shape == par.shape == (3 + 3 * 9,) and keep.shape == (9,)


# -- capture and replay (CUDA only) ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("kind,opts", SHAPES[:3])
def test_captured_drafting_replays_the_static_functions(kind, opts):
    t = tiny_llama(vocab=64, layers=2)
    t.model.to("cuda")
    runs = []
    for capture in (False, True):
        d = recorded(load_drafter(kind, target=t, **opts))
        g = SpeculativeGenerator(t, d, adaptive=False, cuda_graphs=False)
        d.use_cuda_graphs(True, capture=capture)
        assert d._graphs is capture and d.head.device.type == "cuda"
        outs = [g.generate(prompt_ids=torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n))[0].tolist(),
                           max_new_tokens=24, stop_at_eos=False).token_ids for n in (40, 7)]
        runs.append((outs, d.seen, d._graphed.captures))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert runs[0][2] == 0 and runs[1][2] >= 2  # a queue bucket and the draft shape, at least
    plain = SpeculativeGenerator(t, None, cuda_graphs=False)
    assert runs[1][0][1] == plain.generate(prompt_ids=torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(7))[0].tolist(),
                                           max_new_tokens=24, stop_at_eos=False).token_ids


def test_forks_get_their_own_cache_and_lookup_passes_the_switch_on(target):
    from specfoundry.runtime.drafters.lookup import LookupFirstDrafter

    d = load_drafter("eagle3", target=target, tree="chain", depth=2)
    d.use_cuda_graphs(True, capture=False)
    d.begin(torch.tensor([[1, 2, 3]]), torch.zeros(1, 2, 3, 32, dtype=target.dtype))
    twin = d.fork()  # a serving sequence's drafter: its own cache, eager unless switched on
    assert twin.cache is None and twin._graphed is None and twin._graphs is None
    twin.begin(torch.tensor([[4, 5]]), torch.zeros(1, 1, 3, 32, dtype=target.dtype))
    assert twin.cache is not d.cache and twin._graphed is None and d._graphed.cache is d.cache
    twin.use_cuda_graphs(True, capture=False)
    twin.begin(torch.tensor([[4, 5]]), torch.zeros(1, 1, 3, 32, dtype=target.dtype))
    assert twin._graphed.cache is twin.cache is not d.cache
    wrapped = LookupFirstDrafter(load_drafter("eagle3", target=target, tree="chain", depth=2), min_match=1)
    wrapped.use_cuda_graphs(True, capture=False)
    assert wrapped.inner._graphs is False
    wrapped.use_cuda_graphs(False)
    assert wrapped.inner._graphs is None


def test_the_generator_switches_the_head_graphs_with_the_target_graphs(target, monkeypatch):
    """A graphed target (wrapped by the generator on CUDA, or by the caller) switches the head's
    static drafting on; an eager one off. The head here is on the CPU, so "on" is faked."""
    from specfoundry.runtime.cuda_graph import GraphedTarget

    d = load_drafter("eagle3", target=target, tree="chain", depth=2)
    calls = []
    monkeypatch.setattr(d, "use_cuda_graphs", lambda on, capture=None: calls.append(on))
    SpeculativeGenerator(GraphedTarget(target), d)
    SpeculativeGenerator(target, d)
    assert calls == [True, False]
