"""Statistical tests: sampling verification must be lossless.

Setup: a toy "language" over V=5 tokens. The target and the drafter are lookup tables of raw
logits indexed by the prefix (tokens emitted since the root); both go through the same
``probs_from_logits`` (temperature != 1, top-p or top-k). A huge batch (B rows, same tree
shape) is drafted for real (tokens sampled from q; tree siblings without replacement, or
deterministic top proposals with ``q=None``), verified in one call, and the first L emitted
tokens (accepted drafts, then next_token; if fewer than L, the test continues by sampling
from the exact target table) are compared with their exact joint distribution
``P0[t1] * P1[t1][t2] * ...`` by a chi-square test and a total-variation bound. A
deliberately wrong verifier must fail the same statistic.
"""

import numpy as np
import pytest
import torch
from scipy import stats

from specfoundry.runtime.sampling import SamplingParams, probs_from_logits, sample
from specfoundry.runtime.tree import Draft, path_to, tree_depths
from specfoundry.runtime.verify import VerifyResult, _residual, verify

V = 5
B = 200_000
ALPHA = 1e-3
SP_TOPP = SamplingParams(temperature=0.7, top_p=0.9)
SP_TOPK = SamplingParams(temperature=1.3, top_k=4)


pytestmark = pytest.mark.usefixtures("single_thread")


class Lang:
    """Target / draft conditionals: ``P[d]`` and ``Q[d]`` are ``[V**d, V]`` (flat prefix index)."""

    def __init__(self, sp: SamplingParams, depth: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.sp = sp
        self.TL = [torch.randn(V ** d, V, generator=g, dtype=torch.float64) * 1.5 for d in range(depth + 1)]
        # a flatter drafter that still disagrees with the target a lot
        DL = [torch.randn(V ** d, V, generator=g, dtype=torch.float64) * 0.3 for d in range(depth + 1)]
        self.P = [probs_from_logits(t, sp) for t in self.TL]
        self.Q = [probs_from_logits(t, sp) for t in DL]
        assert all(((q > 0).sum(-1) >= 3).all() for q in self.Q)  # room for 3 distinct siblings
        assert any((p == 0).any() for p in self.P)  # truncation really removes target tokens

    def joint(self, L: int) -> torch.Tensor:
        """Exact distribution of the first L tokens, flat ``[V**L]``."""
        j = self.P[0][0]
        for d in range(1, L):
            j = (j.view(-1, 1) * self.P[d]).reshape(-1)
        return j


def draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row of ``probs`` ``[B, V]`` (cheaper than multinomial)."""
    u = 1.0 - torch.rand(probs.shape[0], 1, generator=g, dtype=probs.dtype)  # (0, 1]: never picks zero mass
    cdf = probs.cumsum(-1)
    return (cdf < u * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)


def make_draft(lang: Lang, parents: list[int], mode: str, g: torch.Generator):
    """Draft B copies of the tree ``parents``.

    mode: "wor" siblings sampled without replacement (q_c renormalised past earlier siblings),
          "wr" with replacement (q_c = parent's q), "top" deterministic best-remaining (q=None).
    Returns (draft, target_logits [B, N, V], prefix index per node [B, N]).
    """
    N = len(parents)
    depth = tree_depths(torch.tensor([parents]))[0].tolist()
    tokens = torch.zeros(B, N, dtype=torch.long)
    pref = torch.zeros(B, N, dtype=torch.long)
    q = torch.zeros(B, N, V, dtype=torch.float64)
    used = {}
    for i in range(1, N):
        pa = parents[i]
        base = lang.Q[depth[pa]][pref[:, pa]]
        m = used.setdefault(pa, torch.zeros(B, V, dtype=torch.bool))
        qi = base if mode == "wr" else base.masked_fill(m, 0.0)
        qi = qi / qi.sum(-1, keepdim=True)
        x = qi.argmax(-1) if mode == "top" else draw(qi, g)
        m[torch.arange(B), x] = True
        tokens[:, i], q[:, i] = x, qi
        pref[:, i] = pref[:, pa] * V + x
    logits = torch.stack([lang.TL[depth[i]][pref[:, i]] for i in range(N)], 1)
    draft = Draft(tokens, torch.tensor(parents).expand(B, N).clone(), None if mode == "top" else q)
    return draft, logits


def emitted(lang: Lang, draft: Draft, res, L: int, g: torch.Generator) -> torch.Tensor:
    """Flat index of the first L emitted tokens; beyond the verifier's output, continue exactly."""
    seq = torch.zeros(B, L, dtype=torch.long)
    pref = torch.zeros(B, dtype=torch.long)
    for j in range(L):
        if j + 1 < res.path.shape[1]:
            node = res.path[:, j + 1].clamp(min=0)
            drafted = draft.tokens.gather(1, node.view(B, 1)).squeeze(1)
        else:
            drafted = torch.zeros(B, dtype=torch.long)
        cont = draw(lang.P[j][pref], g)
        t = torch.where(j < res.accept_len, drafted, torch.where(j == res.accept_len, res.next_token, cont))
        seq[:, j] = t
        pref = pref * V + t
    return pref


def check(lang: Lang, flat: torch.Tensor, L: int):
    """Chi-square p-value and TV distance of ``flat`` vs the exact joint; zero-mass cells must be empty."""
    exact = lang.joint(L)
    obs = torch.bincount(flat, minlength=V ** L).double()
    n = float(obs.sum())
    support = exact > 0
    zero_mass_hits = int(obs[~support].sum())
    e, o = exact[support] * n, obs[support]
    small = e < 5  # pool sparse cells so the chi-square approximation holds
    if small.any():
        e = torch.cat([e[~small], e[small].sum().view(1)])
        o = torch.cat([o[~small], o[small].sum().view(1)])
    pval = stats.chisquare(o.numpy(), e.numpy() * (o.sum() / e.sum()).item()).pvalue
    tv = 0.5 * (obs / n - exact).abs().sum().item()
    # TV reached by exact samples of the same size (largest of 20 simulated draws)
    rng = np.random.default_rng(0)
    sims = rng.multinomial(int(n), (exact / exact.sum()).numpy(), size=20) / n
    tv_noise = 0.5 * np.abs(sims - exact.numpy()).sum(1).max()
    return pval, tv, tv_noise, zero_mass_hits


def assert_exact(lang, flat, L):
    pval, tv, tv_noise, zero = check(lang, flat, L)
    assert zero == 0, f"{zero} samples outside the target's support"
    assert pval > ALPHA, f"chi-square p={pval:.3g} (tv={tv:.4f}, noise~{tv_noise:.4f})"
    assert tv < 1.25 * tv_noise, f"tv={tv:.4f} vs exact-sample max~{tv_noise:.4f}"
    return pval, tv, tv_noise


def assert_detected(lang, flat, L):
    pval, tv, tv_noise, zero = check(lang, flat, L)
    print(f"wrong rule: p={pval:.3g} tv={tv:.4f} noise~{tv_noise:.4f} outside-support={zero}")
    assert pval < 1e-12 or zero > 0, f"wrong rule not detected: p={pval:.3g}"
    assert tv > 2 * tv_noise, f"wrong rule not detected: tv={tv:.4f} vs exact-sample max~{tv_noise:.4f}"


CHAIN = [-1, 0, 1, 2]
#            0
#      1     2     3
#    4   5   6
#    7
TREE = [-1, 0, 0, 0, 1, 1, 2, 4]
CASES = {  # name: (parents, mode, sampling params, lang seed)
    "chain_q_topp": (CHAIN, "wor", SP_TOPP, 1),
    "chain_det_topk": (CHAIN, "top", SP_TOPK, 2),
    "tree_wor_topp": (TREE, "wor", SP_TOPP, 3),
    "tree_wr_topk": (TREE, "wr", SP_TOPK, 4),
    "tree_det_topp": (TREE, "top", SP_TOPP, 5),
}


def run_case(name):
    parents, mode, sp, lang_seed = CASES[name]
    L = max(tree_depths(torch.tensor([parents]))[0].tolist()) + 1
    lang = Lang(sp, L - 1, lang_seed)
    draft, logits = make_draft(lang, parents, mode, torch.Generator().manual_seed(100))
    return lang, draft, logits, L


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_verifier_is_lossless(name):
    lang, draft, logits, L = run_case(name)
    res = verify(draft, logits, lang.sp, torch.Generator().manual_seed(7))
    mean_acc = res.accept_len.double().mean().item()
    assert 0.2 < mean_acc < L - 1.2, mean_acc  # non-trivial mix of acceptances and rejections
    flat = emitted(lang, draft, res, L, torch.Generator().manual_seed(8))
    pval, tv, noise = assert_exact(lang, flat, L)
    print(f"{name}: mean accept {mean_acc:.3f} p={pval:.3g} tv={tv:.4f} noise~{noise:.4f}")


# ----------------------------------------------------------------------------- power checks


def wrong_chain_resample_from_p(draft, probs, g):
    """Chain verifier that on rejection samples from p instead of the residual (a known bug)."""
    Bn, N = draft.tokens.shape
    x = draft.tokens[:, 1:]
    px = probs[:, :-1].gather(-1, x.unsqueeze(-1)).squeeze(-1)
    qx = draft.q[:, 1:].gather(-1, x.unsqueeze(-1)).squeeze(-1)
    acc = torch.rand(Bn, N - 1, generator=g, dtype=probs.dtype) * qx < px
    a = acc.long().cumprod(1).sum(1)
    p_last = probs.gather(1, a.view(Bn, 1, 1).expand(Bn, 1, V)).squeeze(1)
    nxt = sample(p_last, g)
    ar = torch.arange(N).expand(Bn, N)
    return VerifyResult(a, torch.where(ar <= a.view(Bn, 1), ar, -1), nxt)


def test_power_residual_bug_detected():
    lang, draft, logits, L = run_case("chain_q_topp")
    res = wrong_chain_resample_from_p(draft, probs_from_logits(logits, lang.sp), torch.Generator().manual_seed(7))
    assert_detected(lang, emitted(lang, draft, res, L, torch.Generator().manual_seed(8)), L)


def test_power_sibling_renormalisation_bug_detected():
    # tokens drawn without replacement, but q_c recorded as the parent's full q (earlier siblings
    # not removed): the verifier is then told the wrong proposal and must lose exactness
    lang, draft, logits, L = run_case("tree_wor_topp")
    depth = draft.depths[0]
    q = draft.q.clone()
    par = draft.parents[0]
    ppref = torch.zeros(B, draft.num_nodes, dtype=torch.long)
    for i in range(1, draft.num_nodes):
        ppref[:, i] = ppref[:, par[i]] * V + draft.tokens[:, i]
        q[:, i] = lang.Q[depth[par[i]]][ppref[:, par[i]]]
    bad = Draft(draft.tokens, draft.parents, q)
    res = verify(bad, logits, lang.sp, torch.Generator().manual_seed(7))
    assert_detected(lang, emitted(lang, bad, res, L, torch.Generator().manual_seed(8)), L)


def buggy_tree(draft, probs, g, bug):
    """Local copy of recursive rejection over siblings (deterministic proposals) with a planted bug.

    bug=None is the correct rule (sanity check of this copy); "no_update": every sibling is tested
    against the node's untouched p, and after all are rejected next_token comes from p.
    """
    N = draft.num_nodes
    par = draft.parents[0].tolist()
    depths = draft.depths
    kids = [[c for c in range(N) if par[c] == u] for u in range(N)]
    u = torch.zeros(B, dtype=torch.long)
    p = probs[:, 0]
    active = torch.ones(B, dtype=torch.bool)
    for _ in range(int(depths.max())):
        moved = torch.zeros(B, dtype=torch.bool)
        for r in range(max(len(k) for k in kids)):
            c = torch.tensor([kids[n][r] if r < len(kids[n]) else -1 for n in range(N)])[u]
            trying = active & ~moved & (c >= 0)
            x = draft.tokens.gather(1, c.clamp(min=0).view(B, 1)).squeeze(1)
            acc = trying & (torch.rand(B, generator=g, dtype=p.dtype) < p.gather(1, x.view(B, 1)).squeeze(1))
            if bug is None:
                p = torch.where((trying & ~acc).view(B, 1), _residual(p, torch.nn.functional.one_hot(x, V).double()), p)
            u = torch.where(acc, c, u)
            moved |= acc
        active &= moved
        p = torch.where(moved.view(B, 1), probs.gather(1, u.view(B, 1, 1).expand(B, 1, V)).squeeze(1), p)
    a = depths.gather(1, u.view(B, 1)).squeeze(1)
    return VerifyResult(a, path_to(draft.parents, u), sample(p, g))


@pytest.mark.parametrize("bug", [None, "no_update"])
def test_power_no_residual_update_between_siblings_detected(bug):
    lang, draft, logits, L = run_case("tree_det_topp")
    res = buggy_tree(draft, probs_from_logits(logits, lang.sp), torch.Generator().manual_seed(7), bug)
    flat = emitted(lang, draft, res, L, torch.Generator().manual_seed(8))
    if bug is None:
        assert_exact(lang, flat, L)
    else:
        assert_detected(lang, flat, L)
