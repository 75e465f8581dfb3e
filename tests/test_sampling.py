"""The runtime's batched sampler (:func:`specfoundry.runtime.sampling.sample_batch`, what
training-data generation draws with): it stays in the nucleus and draws from exactly the
distribution of :func:`~specfoundry.runtime.sampling.probs_from_logits`."""

import pytest
import torch

from specfoundry.runtime.sampling import SamplingParams, probs_from_logits, sample_batch

pytestmark = pytest.mark.usefixtures("single_thread")


def test_top_p_sampler_stays_in_the_nucleus():
    g = torch.Generator().manual_seed(0)
    V = 5000  # above the 1024-candidate shortcut
    logits = torch.stack([torch.randn(V, generator=g) * 4, torch.zeros(V)])  # peaked row, flat row (full-sort path)
    for top_p in (0.5, 0.9):
        probs = torch.softmax(logits, -1)
        sp, si = probs.sort(-1, descending=True)
        nucleus = [set(si[r][(sp[r].cumsum(0) - sp[r]) < top_p].tolist()) for r in range(2)]
        picks = torch.stack([sample_batch(logits, SamplingParams(1.0, None, top_p), g) for _ in range(300)])
        for r in range(2):
            got = set(picks[:, r].tolist())
            assert got <= nucleus[r]
            assert len(got) > 1
    assert torch.equal(sample_batch(logits, SamplingParams(0.0, None, 0.9), g), logits.argmax(-1))

    # plain temperature sampling draws from softmax(logits / T)
    small = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = sample_batch(small.expand(20000, 6), SamplingParams(0.7, None, 1.0), g)
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    assert torch.allclose(freq, torch.softmax(small.double() / 0.7, -1), atol=0.015)
    # top-p on the same row keeps exactly the nucleus, renormalised
    p = torch.softmax(small.double() / 0.7, -1)
    draws = sample_batch(small.expand(20000, 6), SamplingParams(0.7, None, 0.8), g)
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    nucleus = (p.cumsum(0) - p) < 0.8
    assert torch.allclose(freq, torch.where(nucleus, p, 0) / p[nucleus].sum(), atol=0.015)


def test_data_sampler_draws_from_the_runtime_sampling_distribution():
    # one sampling rule: data generation's fast sampler and runtime.sampling.probs_from_logits agree
    g = torch.Generator().manual_seed(1)
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temperature, top_k, top_p in ((0.7, 0, 1.0), (1.0, 3, 1.0), (0.9, 0, 0.8), (1.3, 5, 0.9)):
        params = SamplingParams(temperature, top_k or None, top_p)
        want = probs_from_logits(row.double(), params)
        draws = sample_batch(row.expand(20000, 7), params, g)
        freq = torch.bincount(draws, minlength=7).double() / draws.numel()
        assert torch.allclose(freq, want, atol=0.015), (temperature, top_k, top_p)
        assert not bool(freq[want == 0].any())
