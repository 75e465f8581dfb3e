"""Target adapter: tree attention equals linear re-runs; KV commit/rollback keeps exactly the
accepted path (non-contiguous tree nodes included). Both decoding paths: the static-cache
engine and the HF ``DynamicCache`` path."""

import pytest
import torch

from tiny_models import tiny_llama
from specfoundry.runtime.tree import ancestor_matrix, path_to, tree_depths, tree_from_choices


@pytest.fixture(scope="module", params=["engine", "hf"])
def tiny_target(request):
    return tiny_llama(0, backend=request.param)


def _cache_len(cache) -> int:
    """Entries physically held: the HF cache's tensor length; the static cache's committed length."""
    if hasattr(cache, "hf"):
        lens = {l.keys.shape[-2] for l in cache.hf.layers}
        assert len(lens) == 1
        return lens.pop()
    return cache.length


def _full_logits(t, ids):
    return t.model(torch.tensor([ids])).logits[0]


def _random_tree(n, g):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return torch.tensor([parents])


@pytest.mark.parametrize("n_nodes,past", [(1, 5), (6, 3), (12, 9), (20, 1)])
def test_tree_node_logits_equal_linear_rerun(tiny_target, n_nodes, past):
    t = tiny_target
    g = torch.Generator().manual_seed(n_nodes * 100 + past)
    prefix = torch.randint(0, 64, (1, past), generator=g)
    parents = _random_tree(n_nodes, g)
    tokens = torch.randint(0, 64, (1, n_nodes), generator=g)
    cache = t.new_cache()
    t.forward(prefix, cache)
    cache.commit()
    out = t.forward(tokens, cache, position_ids=past + tree_depths(parents), tree_mask=ancestor_matrix(parents),
                    feature_layers=(0, 2, 4))
    for node in range(n_nodes):
        path = path_to(parents, torch.tensor([node]))[0]
        path = path[path >= 0]
        seq = prefix[0].tolist() + tokens[0, path].tolist()
        ref = t.model(torch.tensor([seq]), output_hidden_states=True)
        torch.testing.assert_close(out.logits[0, node], ref.logits[0, -1], rtol=0, atol=1e-10)
        for j, layer in enumerate((0, 2, 4)):
            torch.testing.assert_close(out.features[0, node, j], ref.hidden_states[layer][0, -1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("as_list", [False, True])  # a tensor, or the generator's host list
def test_commit_keeps_non_contiguous_path_then_decoding_matches(tiny_target, as_list):
    t = tiny_target
    prefix = torch.arange(7).view(1, -1) + 3
    parents, _ = tree_from_choices([[0, 0, 0], [1, 0], [1, 1, 0], [2]])
    parents = parents.view(1, -1)
    tokens = torch.tensor([[9] + list(range(20, 20 + parents.shape[1] - 1))])
    cache = t.new_cache()
    t.forward(prefix, cache)
    cache.commit()
    t.forward(tokens, cache, position_ids=7 + tree_depths(parents), tree_mask=ancestor_matrix(parents))
    # keep the root and the path through the second child (non-contiguous node indices)
    deepest = int(tree_depths(parents)[0].argmax())
    keep = path_to(parents, torch.tensor([deepest]))[0]
    keep = keep[keep >= 0]
    assert not torch.equal(keep, torch.arange(len(keep))), "test needs a non-contiguous path"
    cache.commit(keep.tolist() if as_list else keep)
    assert cache.length == 7 + len(keep)
    nxt = torch.tensor([[5, 6]])
    out = t.forward(nxt, cache)
    cache.commit()
    seq = prefix[0].tolist() + tokens[0, keep].tolist() + [5, 6]
    torch.testing.assert_close(out.logits[0], _full_logits(t, seq)[-2:], rtol=0, atol=1e-10)
    assert _cache_len(cache) == cache.length


def test_rollback_and_crop(tiny_target):
    t = tiny_target
    ids = torch.arange(10).view(1, -1) + 1
    cache = t.new_cache()
    t.forward(ids[:, :6], cache)
    cache.commit()
    t.forward(ids[:, 6:], cache)
    cache.rollback()
    assert cache.length == 6
    cache.crop(4)
    assert cache.length == 4 and _cache_len(cache) == 4
    out = t.forward(ids[:, 4:], cache)
    cache.commit()
    torch.testing.assert_close(out.logits[0], _full_logits(t, ids[0].tolist())[4:], rtol=0, atol=1e-10)


def test_forward_requires_commit_between_calls(tiny_target):
    cache = tiny_target.new_cache()
    tiny_target.forward(torch.tensor([[1, 2]]), cache)
    with pytest.raises(RuntimeError, match="commit or roll back"):
        tiny_target.forward(torch.tensor([[3]]), cache)


def test_fingerprint_tracks_weights_not_dtype():
    a, b = tiny_llama(0), tiny_llama(1)
    assert a.fingerprint() != b.fingerprint()
    a32 = tiny_llama(0, dtype=torch.float32)
    assert a.fingerprint() == a32.fingerprint()
    ident = a.identity()
    assert set(ident) == {"name", "vocab_size", "hidden_size", "num_layers", "fingerprint"}


def test_cache_argument_spelled_as_the_installed_transformers_takes_it(monkeypatch):
    """transformers 5.24 renamed the models' ``past_key_values`` to ``cache``; an older version
    silently ignores ``cache=`` (no KV cache: a GPU machine with 5.17 failed on the HF path).
    Every call goes through ``hf_cache_kw``: with either spelling (this version still takes the
    old one) the HF target and an EAGLE-3 head on a cache give the same results."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaAttention

    from specfoundry.runtime import SpeculativeGenerator, load_drafter
    from specfoundry.runtime import target as T

    params = inspect.signature(LlamaAttention.forward).parameters
    assert T._cache_kwarg() in params
    target = tiny_llama(0, dtype=torch.float32, backend="hf")
    prompt = [3, 17, 5, 9, 3, 17]

    def run():
        drafter = load_drafter("eagle3", target=target)
        out = SpeculativeGenerator(target, drafter, adaptive=False, max_depth=3).generate(
            prompt_ids=prompt, max_new_tokens=12, stop_at_eos=False)
        plain = SpeculativeGenerator(target).generate(prompt_ids=prompt, max_new_tokens=12, speculate=False,
                                                      stop_at_eos=False)
        cache = T.KVCache()
        torch.manual_seed(0)
        head = drafter.head
        ids = torch.tensor([prompt])
        h1 = head(ids[:, :4], torch.randn(1, 4, target.hidden_size), cache=cache)
        cache.commit()
        h2 = head(ids[:, 4:], torch.randn(1, 2, target.hidden_size), cache=cache)
        cache.commit()
        assert cache.length == 6  # the head's layer wrote its K/V into the cache
        return out.token_ids, plain.token_ids, torch.cat([h1, h2], 1)

    torch.manual_seed(1)
    want = run()
    assert want[0] == want[1]
    for name in ("cache", "past_key_values"):
        monkeypatch.setattr(T, "_cache_kwarg", lambda name=name: name)
        torch.manual_seed(1)
        got = run()
        assert got[:2] == want[:2]
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)


def test_drafter_takes_the_kernels_of_the_target_as_it_is_now():
    """A target moved after its engine was built (``.to('cuda')``, a dtype change) rebuilds the
    engine when next used; a head loaded then must take the new engine's kernels, not the stale
    ones (a CPU kernel picked for a head on CUDA failed on a GPU machine)."""
    from specfoundry.runtime import load_drafter
    from specfoundry.runtime.engine import head_kernels

    target = tiny_llama(0, dtype=torch.float32)
    stale = target.engine
    target.model.to(torch.bfloat16)
    drafter = load_drafter("eagle3", target=target)
    assert target.engine is not stale
    assert drafter.head._linears.kernels == head_kernels(target.engine.kernels)
