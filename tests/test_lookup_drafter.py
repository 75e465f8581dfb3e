"""LookupFirstDrafter's choice rule: prompt lookup when the suffix matches >= min_match tokens,
else the wrapped drafter; both see every commit. (Losslessness: tests/test_lossless.py and
tests/test_sampling_lossless.py run it with real heads.)"""

import pytest
import torch

from specfoundry.runtime.drafters.base import DraftContext, Drafter
from specfoundry.runtime.drafters.lookup import LookupFirstDrafter
from specfoundry.runtime.sampling import SamplingParams
from specfoundry.runtime.tree import Draft


class CountingDrafter(Drafter):
    """Proposes ``[99]`` and records what it was shown."""

    type = "stub"
    default_depth, default_nodes = 3, 4

    def begin(self, prompt_ids, features):
        self.seen = prompt_ids[0].tolist()
        self.calls = 0

    def propose(self, ctx):
        self.calls += 1
        return Draft.chain(ctx.tokens[:, -1], torch.tensor([[99]]))

    def commit(self, new_tokens, features):
        self.seen += new_tokens[0].tolist()


def _ctx(tokens, depth=5, nodes=6):
    return DraftContext(torch.tensor([tokens]), SamplingParams(0.0), depth, nodes)


def test_long_match_drafts_the_copy_short_match_asks_the_model():
    inner = CountingDrafter()
    d = LookupFirstDrafter(inner, min_match=2, lookup_depth=4)
    tokens = [5, 6, 7, 8, 9, 5, 6]
    d.begin(torch.tensor([tokens]), None)
    draft = d.propose(_ctx(tokens))
    assert draft.tokens.tolist() == [[6, 7, 8, 9, 5]]  # root 6, then what followed (5, 6) before
    assert inner.calls == 0 and d.lookups == 1
    d.commit(torch.tensor([[7, 1]]), None)  # accepted 7, bonus 1: suffix (7, 1) never seen
    tokens += [7, 1]
    assert inner.seen == tokens  # the wrapped drafter saw the lookup step's commit too
    draft = d.propose(_ctx(tokens))
    assert draft.tokens.tolist() == [[1, 99]] and inner.calls == 1
    assert (d.lookups, d.model_drafts) == (1, 1)


def test_min_match_and_budget_bound_the_lookup():
    inner = CountingDrafter()
    tokens = [3, 4, 5, 6, 4]  # only a one-token suffix (4) occurred before
    strict = LookupFirstDrafter(inner, min_match=2)
    strict.begin(torch.tensor([tokens]), None)
    assert strict.propose(_ctx(tokens)).tokens.tolist() == [[4, 99]]
    loose = LookupFirstDrafter(CountingDrafter(), min_match=1)
    loose.begin(torch.tensor([tokens]), None)
    assert loose.propose(_ctx(tokens, depth=2, nodes=6)).tokens.tolist() == [[4, 5, 6]]  # depth cap
    assert loose.propose(_ctx(tokens, depth=5, nodes=2)).tokens.tolist() == [[4, 5]]  # node cap


def test_shape_defaults_and_forks_are_independent():
    d = LookupFirstDrafter(CountingDrafter(), min_match=2, lookup_depth=6)
    assert (d.default_depth, d.default_nodes, d.type) == (6, 7, "stub+lookup")
    a, b = d.fork(), d.fork()
    a.begin(torch.tensor([[1, 2, 1]]), None)
    b.begin(torch.tensor([[8, 9]]), None)
    assert a.inner is not b.inner and a.lookup is not b.lookup
    assert a.inner.seen == [1, 2, 1] and b.inner.seen == [8, 9]
    with pytest.raises(ValueError, match="min_match"):
        LookupFirstDrafter(CountingDrafter(), min_match=0)
    with pytest.raises(TypeError, match="Drafter"):
        LookupFirstDrafter(object())


def test_generator_takes_lookup_drafts_before_the_controller_and_keeps_them_out_of_its_estimates(monkeypatch):
    """Under the adaptive controller a lookup draft is verified even where the controller would
    decode plainly, and only the model drafter's steps reach the controller's estimates."""
    from tiny_models import tiny_llama
    from specfoundry.runtime import SpeculativeGenerator, load_drafter
    from specfoundry.runtime.adaptive import AdaptiveController

    recorded = []
    real = AdaptiveController.record
    monkeypatch.setattr(AdaptiveController, "record", lambda self, *a: (recorded.append(a), real(self, *a))[1])
    target = tiny_llama(0)
    d = LookupFirstDrafter(load_drafter("eagle3", target=target, tree="chain", depth=2), min_match=1)
    gen = SpeculativeGenerator(target, d, adaptive=True)
    prompt = [5, 6, 5, 6, 5, 6, 5, 6, 5, 6, 30, 31]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=40)
    n_recorded = len(recorded)
    assert out.token_ids == gen.generate(prompt_ids=prompt, max_new_tokens=40, speculate=False).token_ids
    assert d.lookups > 0 and d.model_drafts > 0
    # every forward is either a lookup step or one the controller chose (and recorded)
    assert n_recorded == out.stats.target_forwards - d.lookups


def test_with_lookup_wraps_model_drafters_only():
    from tiny_models import tiny_llama
    from specfoundry.runtime import load_drafter
    from specfoundry.runtime.drafters.lookup import with_lookup

    target = tiny_llama(0)
    ngram, head = load_drafter("ngram", target=target), load_drafter("eagle3", target=target)
    assert with_lookup(ngram, 2) is ngram and with_lookup(head, 0) is head and with_lookup(None, 2) is None
    wrapped = with_lookup(head, 3)
    assert isinstance(wrapped, LookupFirstDrafter) and wrapped.inner is head and wrapped.lookup.min_ngram == 3
    with pytest.raises(ValueError, match="--prompt-lookup"):
        with_lookup(head, -1)
