"""The runtime's samplers: :func:`~specfoundry.runtime.sampling.sample_batch` (what training-data
generation draws with) stays in the nucleus and draws from exactly the distribution of
:func:`~specfoundry.runtime.sampling.probs_from_logits`, whose top-p shortcut keeps the sort-based
rule; :func:`~specfoundry.runtime.sampling.sample` draws each row by its distribution."""

import pytest
import torch

from specfoundry.runtime.sampling import SamplingParams, probs_from_logits, sample, sample_batch

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
        for uniforms in (None, torch.rand(20000, generator=g, dtype=torch.float64)):  # caller-given draws too
            draws = sample_batch(row.expand(20000, 7), params, g, uniforms)
            freq = torch.bincount(draws, minlength=7).double() / draws.numel()
            assert torch.allclose(freq, want, atol=0.015), (temperature, top_k, top_p, uniforms is None)
            assert not bool(freq[want == 0].any())
    # given uniforms decide the draw: the same ones, the same tokens, whatever the generator
    u = torch.rand(64, generator=g, dtype=torch.float64)
    logits = torch.randn(64, 300, generator=g) * 3
    for params in (SamplingParams(1.0, None, 1.0), SamplingParams(0.8, 20, 0.9)):
        a = sample_batch(logits, params, torch.Generator().manual_seed(5), u)
        assert torch.equal(a, sample_batch(logits, params, torch.Generator().manual_seed(6), u))
        assert torch.equal(a[10:20], sample_batch(logits[10:20], params, None, u[10:20]))  # a row's draw is its own


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference rule: a full sort, the smallest prefix reaching top_p, renormalised."""
    sp, si = probs.sort(-1, descending=True)
    drop = torch.zeros_like(sp, dtype=torch.bool).scatter(-1, si, (sp.cumsum(-1) - sp) >= top_p)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def test_top_p_without_a_full_sort_keeps_the_sorted_rule():
    # rows whose nucleus lies in the top 64, in the top 1024 and past it (the full-sort fallback),
    # batched and with leading dims: the same tokens and values as the sort-based rule
    g = torch.Generator().manual_seed(3)
    V = 5000
    logits = torch.stack([torch.randn(V, generator=g) * s for s in (8.0, 3.0, 1.0, 0.0)]).view(2, 2, V)
    for top_p in (0.3, 0.9, 0.99):
        params = SamplingParams(1.0, None, top_p)
        got = probs_from_logits(logits, params)
        want = _sorted_nucleus(torch.softmax(logits, -1), top_p)
        assert torch.equal(got > 0, want > 0), top_p
        assert torch.allclose(got, want, atol=1e-7), top_p
    sizes = (probs_from_logits(logits, SamplingParams(1.0, None, 0.9)) > 0).sum(-1).flatten().tolist()
    assert sizes[0] <= 64 < sizes[1] <= 1024 < sizes[2], sizes  # every path of the shortcut ran


def test_sample_draws_each_row_by_its_distribution():
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    draws = torch.stack([sample(p, g) for _ in range(20000)])  # [n, 2]
    freq = torch.bincount(draws[:, 0], minlength=5).double() / draws.shape[0]
    assert torch.allclose(freq, p[0].double(), atol=0.015)
    assert not bool(freq[p[0] == 0].any())
    assert bool((draws[:, 1] == 4).all())
    assert sample(p[0], g).shape == () and sample(p.view(1, 2, 5), g).shape == (1, 2)
    for bad in (torch.zeros(1, 5), torch.tensor([[0.5, float("nan"), 0.5]])):
        with pytest.raises(ValueError, match="positive, finite"):
            sample(bad, g)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
def test_sample_batch_on_cuda_with_host_uniforms():
    """Training's data stage draws with per-row uniforms kept on the CPU while the logits are on
    CUDA; nucleus sampling indexed those uniforms with CUDA row indices (failed on an H200)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    params = SamplingParams(0.8, top_p=0.9)
    want = sample_batch(logits, params, None, u)
    got = sample_batch(logits.cuda(), params, None, u)
    assert got.device.type == "cuda" and got.cpu().tolist() == want.tolist()
