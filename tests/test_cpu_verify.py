"""Speculative sampling's verification of one chain in C (runtime/cpu_verify.py): the PyTorch
verifier's decisions with the same random numbers, the target's distribution by chi-square, and
non-finite logits handed back to PyTorch with the generator untouched."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specfoundry.runtime import cpu_verify
from specfoundry.runtime.sampling import SamplingParams, probs_from_logits, sample
from specfoundry.runtime.tree import Draft
from specfoundry.runtime.verify import verify, verify_sampling_chain

pytestmark = pytest.mark.skipif(not cpu_verify.available(), reason="no AVX-512 BF16 kernels on this CPU")


def _case(g, V: int, N: int, dtype, deterministic: bool):
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype)
    if deterministic:  # lookup-style drafts (no q): the target's likeliest tokens, so some are accepted
        logits = (torch.randn(N, V, generator=g) * 6).to(dtype)
        tokens = torch.cat([torch.tensor([0]), logits[:-1].float().argmax(-1)])
        return logits, tokens, None
    # draft distributions over a "draft vocabulary" (a third of the ids), zero elsewhere
    vocab = torch.randperm(V, generator=g)[: V // 3]
    q = torch.zeros(N, V)
    q[:, vocab] = torch.softmax(torch.randn(N, vocab.numel(), generator=g) * 2, -1)
    q[0] = 0
    tokens = torch.cat([torch.randint(0, V, (1,), generator=g), sample(q[1:], g)])
    return logits, tokens, q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_c_verifier_decides_what_the_pytorch_verifier_decides(dtype, deterministic):
    g = torch.Generator().manual_seed(1)
    seen = set()
    for i in range(150):
        V, N = int(torch.randint(17, 400, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        temperature = [1.0, 0.7, 1.6][i % 3]
        logits, tokens, q = _case(g, V, N, dtype, deterministic)
        draft = Draft(tokens.view(1, N), torch.arange(-1, N - 1).view(1, N), None if q is None else q.unsqueeze(0))
        params = SamplingParams(temperature)
        want = verify_sampling_chain(draft, probs_from_logits(logits.unsqueeze(0), params),
                                     torch.Generator().manual_seed(100 + i))
        got = cpu_verify.sampling_chain(tokens, q, logits, temperature, torch.Generator().manual_seed(100 + i))
        assert got == (int(want.accept_len), int(want.next_token)), (i, V, N)
        seen.add(got[0])
        # and through verify(), which takes this path for one chain
        res = verify(draft, logits.unsqueeze(0), params, torch.Generator().manual_seed(100 + i))
        assert (int(res.accept_len), int(res.next_token)) == got and torch.equal(res.path, want.path)
        if q is not None:  # q over the draft vocabulary only (Draft.q_ids): the same decisions, in C and PyTorch
            vocab = (q[1:] > 0).any(0).nonzero().view(-1)
            vocab = vocab[torch.randperm(vocab.numel(), generator=torch.Generator().manual_seed(i))]  # any column order
            assert cpu_verify.sampling_chain(tokens, q[:, vocab], logits, temperature, torch.Generator().manual_seed(100 + i),
                                             vocab) == got
            compact = Draft(draft.tokens, draft.parents, q[:, vocab].unsqueeze(0), q_ids=vocab)
            assert torch.equal(compact.target_q(V), draft.q)
            res = verify(compact, logits.unsqueeze(0), params, torch.Generator().manual_seed(100 + i))
            assert (int(res.accept_len), int(res.next_token)) == got
            res = verify_sampling_chain(compact, probs_from_logits(logits.unsqueeze(0), params),
                                        torch.Generator().manual_seed(100 + i))
            assert (int(res.accept_len), int(res.next_token)) == (int(want.accept_len), int(want.next_token))
    assert len(seen) >= 3  # rejections at several depths and full acceptances were exercised


def test_draft_vocabulary_ids_outside_the_target_vocabulary_are_refused():
    """q over a draft vocabulary whose ids are not all target ids: a rejected draft (where the C sampler
    writes the residual at those ids) is handed back, generator untouched, and the PyTorch path refuses it."""
    logits = torch.randn(2, 50)
    logits[0, 3] = -40.0  # the draft (token 3) is rejected
    q = torch.softmax(torch.randn(2, 4), -1)
    tokens = torch.tensor([0, 3])
    gen = torch.Generator().manual_seed(0)
    before = gen.get_state()
    assert cpu_verify.sampling_chain(tokens, q, logits, 1.0, gen, torch.tensor([3, 7, 50, 9])) is None  # 50: past V
    assert torch.equal(gen.get_state(), before)
    assert cpu_verify.sampling_chain(tokens, q, logits, 1.0, gen, torch.tensor([3, 7, 49, 9]))[0] == 0
    draft = Draft(tokens.view(1, 2), torch.tensor([[-1, 0]]), q.unsqueeze(0), q_ids=torch.tensor([3, 7, 50, 9]))
    with pytest.raises(IndexError):
        verify(draft, logits.unsqueeze(0), SamplingParams(1.0), torch.Generator().manual_seed(0))


def test_non_finite_logits_go_back_to_pytorch_with_the_generator_untouched():
    logits = torch.randn(3, 50)
    q = torch.zeros(3, 50)
    q[1:, :10] = 0.1
    tokens = torch.tensor([0, 3, 4])
    gen = torch.Generator().manual_seed(5)
    logits[0, 2] = float("nan")  # row 0 is always needed
    assert cpu_verify.sampling_chain(tokens, q, logits, 1.0, gen) is None
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=torch.Generator().manual_seed(5)))
    # a temperature so small that the scaled logits overflow: PyTorch's T -> 0 limit handles it
    assert cpu_verify.sampling_chain(tokens, q, torch.randn(3, 50) * 1e3, 1e-38, torch.Generator()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_emitted_tokens_have_the_targets_distribution(dtype):
    """Two-draft chains from q != p: the first emitted token and the pair follow the target, by
    chi-square over 20,000 trials; the same test rejects the draft's own distribution."""
    V = 6
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, V, generator=g) * 1.5).to(dtype)
    p = probs_from_logits(logits, SamplingParams(1.0))  # [3, V] rows after root, after x1, after x2
    q = torch.zeros(3, V)
    q[1:] = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    n = 20000
    first, pairs = np.zeros(V), {}
    for i in range(n):
        gen = torch.Generator().manual_seed(10_000 + i)
        x = sample(q[1:], gen)  # both drafts from their q (the second's q does not depend on x1 here)
        acc, nxt = cpu_verify.sampling_chain(torch.cat([torch.tensor([0]), x]), q, logits, 1.0, gen)
        out = x[:acc].tolist() + [nxt]
        first[out[0]] += 1
        if len(out) >= 2:
            pairs[tuple(out[:2])] = pairs.get(tuple(out[:2]), 0) + 1
    def fit(obs, dist):
        e = dist.double().numpy()
        return chisquare(obs, e / e.sum() * obs.sum()).pvalue

    assert fit(first, p[0]) > 1e-3
    assert fit(first, q[1]) < 1e-3  # the test can fail
    # pairs: only when the first draft was accepted is row 1 the target's next distribution for x1;
    # given out[0] == x1 accepted, out[1] ~ p[1]: check the conditional on the most frequent x1
    x1 = int(first.argmax())
    cond = np.array([pairs.get((x1, t), 0) for t in range(V)], float)
    assert cond.sum() > 500
    assert fit(cond, p[1]) > 1e-3
