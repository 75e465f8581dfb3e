"""Drafts drawn at a multiple of the request's temperature (runtime/calibrate.py): the scale chosen from
measured acceptance, what the drafters draw with it, and where a checkpoint keeps it. (That the output
stays the target's distribution at any scale: tests/test_sampling_lossless.py.)"""

import pytest
import torch

from test_serving_drafts import _features
from tiny_models import TINY_PROMPTS, tiny_llama, tiny_target_with_smollm2_tokenizer
from specfoundry.runtime import load_drafter, load_target
from specfoundry.runtime.calibrate import _teacher_forced, acceptance_by_scale, choose_scale, measure_draft_temperature
from specfoundry.runtime.drafters.base import DraftContext
from specfoundry.runtime.sampling import SamplingParams
from specfoundry.runtime.serving.drafts import SlotDrafts
from specfoundry.runtime.speculators import Eagle3Head, read_config, save_speculator
from specfoundry.runtime.speculators.checkpoint import CheckpointError, draft_temperature_problems, set_draft_temperature

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_scale_where_the_heads_q_is_the_targets_p_wins():
    """Draft logits 0.7x the target's: at 0.7 T the head's softmax is the target's p, every row is
    accepted with probability 1 and the scale is chosen; a draft vocabulary counts its columns only."""
    g = torch.Generator().manual_seed(0)
    tl = torch.randn(40, 30, generator=g, dtype=torch.float64) * 3
    scales = (0.5, 0.7, 1.0, 1.25)
    for T in (0.6, 1.0, 1.7):
        acc = acceptance_by_scale(tl, 0.7 * tl, None, T, scales)
        assert acc[1] == pytest.approx(40, rel=1e-5) and bool((acc[[0, 2, 3]] < 39).all())
        assert choose_scale({c: float(a) for c, a in zip(scales, acc)}) == 0.7
    d2t = torch.tensor([5, 2, 17, 9])
    acc = acceptance_by_scale(tl, 0.7 * tl[:, d2t], d2t, 1.0, scales)
    p = torch.softmax(tl, -1)
    for i, c in enumerate(scales):  # the sum over positions of sum_j min(p(d2t[j]), q_c(j)), written out
        q = torch.softmax(0.7 * tl[:, d2t] / c, -1)
        want = sum(min(float(p[m, d2t[j]]), float(q[m, j])) for m in range(40) for j in range(4))
        assert float(acc[i]) == pytest.approx(want, rel=1e-5)
    assert choose_scale({0.8: 0.5, 1.0: 0.5, 1.25: 0.5}) == 1.0  # equals: the head's own temperature
    with pytest.raises(ValueError, match="temperature"):
        acceptance_by_scale(tl, tl, None, 0.0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(2, vocab=64, layers=2)


def _chain(drafter, ids, feats, T, seed):
    d = drafter.fork()
    d.begin(ids, feats)
    return d.propose(DraftContext(ids, SamplingParams(T), 2, 3, torch.Generator().manual_seed(seed)))


def test_drafters_draw_at_the_scaled_temperature(target):
    """A drafter at scale c answering a request at T draws exactly what one at scale 1 draws at c*T
    (tokens and recorded q), the serving engine's batched rows too; and c changes q."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, 9), generator=g)
    base = load_drafter("eagle3", target, tree="chain", depth=2)
    feats = _features(g, 8, len(base.feature_layers), target.hidden_size)
    scaled = load_drafter("eagle3", target, tree="chain", depth=2, draft_temperature=0.5)
    assert scaled.draft_temperature == 0.5 and base.draft_temperature == 1.0
    for seed in range(3):
        a, b = _chain(scaled, ids, feats, 1.4, seed), _chain(base, ids, feats, 0.7, seed)
        assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.q, b.q)
        assert not torch.allclose(a.q, _chain(base, ids, feats, 1.4, seed).q)
        slots = SlotDrafts(base.head, slots=1, capacity=64, draft_temperature=0.5)
        slots.begin(0, ids, feats)
        batched = slots.propose([0], [ids[0, -1:]], 2, [SamplingParams(1.4)], [torch.Generator().manual_seed(seed)])[0]
        assert torch.equal(batched.tokens, a.tokens) and torch.allclose(batched.q, a.q)
    for bad in (0, -1, 5.0, "hot"):
        with pytest.raises(ValueError, match="draft_temperature"):
            load_drafter("eagle3", target, draft_temperature=bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2):
    d = tiny_target_with_smollm2_tokenizer(tmp_path_factory.mktemp("tiny-target"), smollm2.vocab_size)
    return load_target(str(d))


def test_teacher_forced_logits_are_the_first_drafts_of_a_drafting_step(tiny):
    """The measurement's head logits for a token are those of the drafter's first draft after the text
    before it (the pairs and offsets of a drafting step), its target logits the target's there."""
    drafter = load_drafter("eagle3", target=tiny, tree="chain", depth=1)
    ids = list(range(100, 112))
    start = 6
    tl, dl = _teacher_forced(tiny, drafter.head, ids, start)
    assert tl.shape == (len(ids) - start, tiny.vocab_size) and dl.shape[0] == len(ids) - start
    d2t = drafter.head.draft_to_target
    for t in (start, start + 3, len(ids) - 1):
        prefix = torch.tensor([ids[:t]])
        cache = tiny.new_cache(capacity=64)
        out = tiny.forward(prefix[:, :-1], cache, feature_layers=drafter.feature_layers)
        cache.commit()
        d = drafter.fork()
        d.begin(prefix, out.features)
        q = d.propose(DraftContext(prefix, SamplingParams(1.0), 1, 2, torch.Generator().manual_seed(0))).q[0, 1]
        got = (q[d2t] if d2t is not None else q).log()
        err = (got - torch.log_softmax(dl[t - start].float(), -1)).abs().max()
        # the next position's drafts are far from these (the check tells one offset from another)
        other = (got - torch.log_softmax(dl[t - start - 1].float(), -1)).abs().max()
        assert err < 0.05 < other, (t, err, other)
        root = tiny.forward(prefix[:, -1:], cache).logits[0, -1]
        assert torch.allclose(tl[t - start].float(), root.float(), atol=2e-2), t


def test_a_measured_scale_is_stored_validated_and_loaded(tiny, tmp_path):
    head = Eagle3Head.from_target(tiny, draft_vocab_size=256, seed=0)
    spec = save_speculator(head, tmp_path / "spec", tiny, training={})
    drafter = load_drafter(str(spec), target=tiny)
    assert drafter.draft_temperature == 1.0  # nothing measured: the head's own temperature
    measured = measure_draft_temperature(tiny, drafter, TINY_PROMPTS[:2], temperatures=(1.0,), max_new_tokens=6,
                                         progress=False)
    assert measured["positions"] > 0 and measured["prompts"] == 2
    assert set(measured["acceptance"]) == {"0.5", "0.6", "0.7", "0.8", "0.9", "1", "1.1", "1.25"}
    best = max(measured["acceptance"].values())
    assert measured["acceptance"][f"{measured['scale']:g}"] == best
    assert draft_temperature_problems(measured) == []
    set_draft_temperature(spec, {**measured, "scale": 0.6})
    assert read_config(spec)["training"]["draft_temperature"]["scale"] == 0.6
    assert load_drafter(str(spec), target=tiny).draft_temperature == 0.6
    assert load_drafter(str(spec), target=tiny, draft_temperature=0.9).draft_temperature == 0.9  # the caller's wins
    assert load_drafter(str(spec), target=tiny, tree="chain", depth=2).draft_temperature == 0.6  # a named shape keeps it
    for bad, where in (({"scale": 0}, "scale"), ({"scale": 9.0}, "scale"), ({"acceptance": {}}, "scale"),
                       ({"scale": 0.7, "hot": 1}, "hot"), ({"scale": "0.7"}, "scale")):
        with pytest.raises(CheckpointError, match=f"training.draft_temperature.{where}"):
            set_draft_temperature(spec, bad)
    assert load_drafter(str(spec), target=tiny).draft_temperature == 0.6  # a refused value is not written
