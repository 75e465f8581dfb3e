"""Unit tests for runtime/verify.py with stub logits / probabilities (exact outcomes)."""

import torch
import pytest

from specfoundry.runtime.sampling import SamplingParams, probs_from_logits
from specfoundry.runtime.tree import Draft, path_to, tree_depths
from specfoundry.runtime.verify import (
    VerifyResult,
    _path,
    _residual,
    verify,
    verify_greedy_chain,
    verify_greedy_tree,
    verify_sampling_chain,
    verify_sampling_tree,
)

V = 8
NEG = float("-inf")


def logits_with_argmax(am):
    """[B, N] argmax ids -> [B, N, V] logits whose argmax is exactly that."""
    am = torch.as_tensor(am)
    return torch.nn.functional.one_hot(am, V).float() * 5.0


def onehot(tok, n=V, dtype=torch.float32):
    return torch.nn.functional.one_hot(torch.as_tensor(tok), n).to(dtype)


def same(a: VerifyResult, b: VerifyResult):
    assert torch.equal(a.accept_len, b.accept_len)
    assert torch.equal(a.path, b.path)
    assert torch.equal(a.next_token, b.next_token)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- greedy chain


def test_greedy_chain_never_always_partial():
    # rows: never accepted / always accepted / partially accepted (a later match must not count)
    drafts = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    am = torch.tensor([
        [7, 2, 3, 4, 5],  # first draft 1 != 7
        [1, 2, 3, 4, 6],  # all match, bonus 6
        [1, 2, 0, 4, 5],  # 1, 2 match; 3 != 0; 4 == 4 but after a mismatch
    ])
    d = Draft.chain(torch.tensor([9, 9, 9]), drafts)
    r = verify_greedy_chain(d, logits_with_argmax(am))
    assert r.accept_len.tolist() == [0, 4, 2]
    assert r.path.tolist() == [[0, -1, -1, -1, -1], [0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]
    assert r.next_token.tolist() == [7, 6, 0]
    same(r, verify_greedy_tree(d, logits_with_argmax(am)))
    same(r, verify(d, logits_with_argmax(am), SamplingParams()))


def test_greedy_chain_root_only():
    d = Draft.root_only(torch.tensor([3, 4]))
    r = verify_greedy_chain(d, logits_with_argmax([[5], [6]]))
    assert r.accept_len.tolist() == [0, 0]
    assert r.path.tolist() == [[0], [0]]
    assert r.next_token.tolist() == [5, 6]
    same(r, verify_greedy_tree(d, logits_with_argmax([[5], [6]])))
    for f in (verify_sampling_tree, verify_sampling_chain):
        s = f(d, onehot([[5], [6]]), gen())
        assert s.path.tolist() == [[0], [0]] and s.next_token.tolist() == [5, 6]
        assert s.accept_len.tolist() == [0, 0]


# ----------------------------------------------------------------------------- greedy tree

#        0
#      1   2
#     3 4   5
#     6
TREE = [-1, 0, 0, 1, 1, 2, 3]


def tree_draft(tokens, parents=TREE, q=None):
    t = torch.as_tensor(tokens)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    p = torch.as_tensor(parents).expand_as(t).clone()
    return Draft(t, p, q)


def test_greedy_tree_never():
    d = tree_draft([0, 1, 2, 3, 4, 5, 6])
    r = verify_greedy_tree(d, logits_with_argmax([[7, 3, 5, 6, 0, 0, 0]]))
    assert r.accept_len.tolist() == [0]
    assert r.path.tolist() == [[0, -1, -1, -1]]
    assert r.next_token.tolist() == [7]


def test_greedy_tree_always_deepest():
    d = tree_draft([0, 1, 2, 3, 4, 5, 6])
    #   am[0]=1 (node1), am[1]=3 (node3), am[3]=6 (node6), am[6]=7 (bonus)
    r = verify_greedy_tree(d, logits_with_argmax([[1, 3, 5, 6, 0, 0, 7]]))
    assert r.accept_len.tolist() == [3]
    assert r.path.tolist() == [[0, 1, 3, 6]]
    assert r.next_token.tolist() == [7]


def test_greedy_tree_partial_needs_whole_path():
    d = tree_draft([0, 1, 2, 3, 4, 5, 6])
    # node2 (am[0]=2) and node5 (am[2]=5) accepted; node6 matches its parent's argmax (am[3]=6)
    # but node3 is not accepted, so node6 is not either
    r = verify_greedy_tree(d, logits_with_argmax([[2, 3, 5, 6, 0, 4, 0]]))
    assert r.accept_len.tolist() == [2]
    assert r.path.tolist() == [[0, 2, 5, -1]]
    assert r.next_token.tolist() == [4]


def test_greedy_tree_ties_lowest_index():
    # duplicated sibling tokens: nodes 1 and 2 both match, and so do 4 (child of 1) and 5 (child of 2)
    d = tree_draft([0, 1, 1, 3, 4, 4, 6])
    r = verify_greedy_tree(d, logits_with_argmax([[1, 4, 4, 0, 2, 3, 0]]))
    assert r.accept_len.tolist() == [2]
    assert r.path.tolist() == [[0, 1, 4, -1]]
    assert r.next_token.tolist() == [2]


def test_greedy_batch_rows_independent_and_per_row_structure():
    torch.manual_seed(0)
    B, N = 6, 7
    parents = torch.tensor([TREE, [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 0, 0, 0],
                            TREE, [-1, 0, 1, 1, 2, 2, 0], [-1, 0, 0, 1, 2, 3, 4]])
    logits = torch.randn(B, N, V)
    am = logits.argmax(-1)
    tokens = torch.randint(0, V, (B, N))
    # make many nodes match so that rows accept different depths
    tokens = torch.where(torch.rand(B, N) < 0.7, am.gather(1, parents.clamp(min=0)), tokens)
    d = Draft(tokens, parents)
    r = verify_greedy_tree(d, logits)
    for b in range(B):
        rb = verify_greedy_tree(Draft(tokens[b:b + 1], parents[b:b + 1]), logits[b:b + 1])
        assert r.accept_len[b] == rb.accept_len[0] and r.next_token[b] == rb.next_token[0]
        w = rb.path.shape[1]
        assert r.path[b, :w].tolist() == rb.path[0].tolist()
        assert (r.path[b, w:] == -1).all()
    assert r.accept_len.max() > 0 and r.accept_len.min() < r.accept_len.max()


def test_greedy_chain_fast_path_agrees_with_tree_random():
    torch.manual_seed(1)
    B, k = 64, 5
    logits = torch.randn(B, k + 1, 4)  # small vocab: frequent matches
    drafts = torch.randint(0, 4, (B, k))
    d = Draft.chain(torch.zeros(B, dtype=torch.long), drafts)
    a, b = verify_greedy_chain(d, logits), verify_greedy_tree(d, logits)
    same(a, b)
    assert a.accept_len.max() >= 2


# ----------------------------------------------------------------------------- sampling chain


def test_sampling_chain_onehot_target_always_accepted():
    B, k = 50, 3
    drafts = torch.tensor([2, 5, 1]).expand(B, k)
    q = torch.softmax(torch.randn(B, k, V, generator=gen(1)), -1)  # any q with q(x) > 0
    p = onehot([2, 5, 1, 7]).expand(B, k + 1, V)
    for dq in (q, None):
        d = Draft.chain(torch.zeros(B, dtype=torch.long), drafts, dq)
        for f in (verify_sampling_chain, verify_sampling_tree):
            r = f(d, p, gen(3))
            assert (r.accept_len == 3).all()
            assert (r.path == torch.arange(4)).all()
            assert (r.next_token == 7).all()
        # same through the dispatcher with -inf logits (temperature and top-p do not matter)
        logits = torch.full((B, k + 1, V), NEG)
        logits.scatter_(-1, torch.tensor([2, 5, 1, 7]).expand(B, k + 1).unsqueeze(-1), 0.0)
        r = verify(d, logits, SamplingParams(temperature=0.6, top_p=0.8), gen(4))
        assert (r.accept_len == 3).all() and (r.next_token == 7).all()


def test_sampling_chain_zero_mass_rejected_next_from_residual():
    B = 400
    p0 = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0])
    q1 = torch.tensor([0.5, 0.1, 0.4, 0, 0, 0, 0, 0])
    # draft token 2 has p0(2) = 0 -> always rejected; residual max(p0 - q1, 0) = onehot(1):
    # token 0 (p0(0) = 0.5) must never come out, which it would if we resampled from p0
    p = torch.stack([p0, onehot(3), onehot(4)]).expand(B, 3, V)
    q = torch.stack([q1, onehot(3)]).expand(B, 2, V)
    d = Draft.chain(torch.zeros(B, dtype=torch.long), torch.tensor([2, 3]).expand(B, 2), q)
    for f in (verify_sampling_chain, verify_sampling_tree):
        r = f(d, p, gen(0))
        assert (r.accept_len == 0).all()
        assert (r.path == torch.tensor([0, -1, -1])).all()
        assert (r.next_token == 1).all()
    # deterministic proposal: residual is p0 with token 2 zeroed = p0 itself -> both 0 and 1 appear
    d = Draft.chain(torch.zeros(B, dtype=torch.long), torch.tensor([2, 3]).expand(B, 2))
    r = verify_sampling_chain(d, p, gen(0))
    assert (r.accept_len == 0).all()
    assert set(r.next_token.tolist()) == {0, 1}


def test_sampling_chain_partial_then_residual():
    B = 300
    # node1 accepted surely (p0 one-hot at it); node2 rejected surely (p1 gives it no mass)
    p = torch.stack([onehot(4), torch.tensor([0, 0, 0.25, 0.75, 0, 0, 0, 0]), onehot(0)]).expand(B, 3, V)
    d = Draft.chain(torch.zeros(B, dtype=torch.long), torch.tensor([4, 6]).expand(B, 2))
    r = verify_sampling_chain(d, p, gen(2))
    assert (r.accept_len == 1).all()
    assert (r.path == torch.tensor([0, 1, -1])).all()
    assert set(r.next_token.tolist()) == {2, 3}


# ----------------------------------------------------------------------------- sampling tree


def test_sampling_tree_recursive_siblings():
    B = 300
    #   0 -> 1 (tok 2), 2 (tok 1), 3 (tok 5);  2 -> 4 (tok 4);  1 -> 5 (tok 6)
    parents = [-1, 0, 0, 0, 2, 1]
    tokens = [0, 2, 1, 5, 4, 6]
    p0 = torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0])
    q1 = torch.tensor([0.5, 0.1, 0.4, 0, 0, 0, 0, 0])  # node1 ~ q1: p0(2) = 0, always rejected
    q2 = torch.tensor([0.5, 0.1, 0, 0, 0, 0, 0, 0]) / 0.6  # node2 ~ q1 without token 2
    # after rejecting node1, p = onehot(1), so node2 (tok 1) is accepted with prob 1
    q3 = torch.tensor([0.5, 0, 0, 0, 0, 0.5, 0, 0])
    z = torch.zeros(V)
    P = torch.stack([p0, onehot(3), onehot(4), onehot(0), onehot(7), onehot(6)]).expand(B, 6, V)
    Q = torch.stack([z, q1, q2, q3, onehot(4), onehot(6)]).expand(B, 6, V)
    d = tree_draft(torch.tensor(tokens).expand(B, 6), parents, Q)
    r = verify_sampling_tree(d, P, gen(0))
    assert (r.accept_len == 2).all()
    assert (r.path == torch.tensor([0, 2, 4])).all()
    assert (r.next_token == 7).all()
    assert not torch.isnan(P).any()


def test_sampling_tree_deterministic_proposals():
    B = 200
    parents = [-1, 0, 0, 0, 1, 3]
    tokens = [0, 2, 1, 5, 4, 6]
    # root p: mass only on 5 and 3 -> node1 (2) and node2 (1) rejected with q one-hot
    p0 = torch.tensor([0, 0, 0, 0.5, 0, 0.5, 0, 0])
    P = torch.stack([p0, onehot(0), onehot(0), onehot(6), onehot(0), onehot(1)]).expand(B, 6, V)
    d = tree_draft(torch.tensor(tokens).expand(B, 6), parents)
    r = verify_sampling_tree(d, P, gen(0))
    acc = r.accept_len == 2  # node3 (tok 5) accepted, then node5 (tok 6) surely, bonus 1
    assert (r.path[acc] == torch.tensor([0, 3, 5])).all() and (r.next_token[acc] == 1).all()
    # otherwise all three root children rejected; residual is p0 without 2, 1, 5 -> token 3
    rej = ~acc
    assert (r.accept_len[rej] == 0).all() and (r.next_token[rej] == 3).all()
    assert (r.path[rej] == torch.tensor([0, -1, -1])).all()
    assert 0.35 < acc.float().mean() < 0.65


def test_sampling_batch_rows_independent_mixed_structures():
    # rows with different structures and deterministic outcomes, alone and together
    rows = [
        ([-1, 0, 1, 2], [0, 3, 4, 5], [onehot(3), onehot(4), onehot(1), onehot(6)], 2, [0, 1, 2, -1], 1),
        ([-1, 0, 0, 1], [0, 3, 4, 5], [onehot(4), onehot(0), onehot(2), onehot(6)], 1, [0, 2, -1, -1], 2),
        ([-1, 0, 0, 0], [0, 3, 4, 5], [onehot(7), onehot(0), onehot(0), onehot(6)], 0, [0, -1, -1, -1], 7),
    ]
    parents = torch.tensor([r[0] for r in rows])
    tokens = torch.tensor([r[1] for r in rows])
    P = torch.stack([torch.stack(r[2]) for r in rows])
    res = verify_sampling_tree(Draft(tokens, parents), P, gen(0))
    for b, (_, _, _, al, path, nxt) in enumerate(rows):
        assert res.accept_len[b] == al and res.next_token[b] == nxt
        alone = verify_sampling_tree(Draft(tokens[b:b + 1], parents[b:b + 1]), P[b:b + 1], gen(9))
        w = alone.path.shape[1]
        assert alone.accept_len[0] == al and alone.next_token[0] == nxt
        assert res.path[b].tolist() == path and alone.path[0].tolist() == path[:w]


def test_sampling_chain_fast_path_agrees_with_tree_same_seed():
    # the chain fast path consumes the generator exactly like the tree verifier (CPU)
    B, k, Vs = 500, 4, 6
    g = gen(11)
    q = torch.softmax(torch.randn(B, k, Vs, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, Vs), 1, generator=g).view(B, k)
    p = torch.softmax(torch.randn(B, k + 1, Vs, generator=g), -1)
    for dq in (q, None):
        d = Draft.chain(torch.zeros(B, dtype=torch.long), drafts, dq)
        a, b = verify_sampling_chain(d, p, gen(5)), verify_sampling_tree(d, p, gen(5))
        same(a, b)
        assert 0 < a.accept_len.float().mean() < k
        sp = SamplingParams(temperature=0.8, top_p=0.9)
        logits = torch.log(p)
        same(verify(d, logits, sp, gen(5)), verify_sampling_chain(d, probs_from_logits(logits, sp), gen(5)))


def test_sampling_reproducible_and_pure():
    B, Vs = 64, 5
    g = gen(2)
    parents = torch.tensor([-1, 0, 0, 1, 2]).expand(B, 5).clone()
    tokens = torch.randint(0, Vs, (B, 5), generator=g)
    q = torch.softmax(torch.randn(B, 5, Vs, generator=g), -1)
    p = torch.softmax(torch.randn(B, 5, Vs, generator=g), -1)
    d = Draft(tokens, parents, q)
    snap = [t.clone() for t in (tokens, parents, q, p)]
    torch.manual_seed(0)
    a = verify_sampling_tree(d, p, gen(7))
    torch.manual_seed(1)  # the global RNG must not matter when a generator is passed
    b = verify_sampling_tree(d, p, gen(7))
    same(a, b)
    for s, t in zip(snap, (tokens, parents, q, p)):
        assert torch.equal(s, t)


# ----------------------------------------------------------------------------- NaN guards


def test_residual_guard():
    p = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.2, 0.3, 0.5, 0.0]])
    q = torch.tensor([[0.2, 0.3, 0.5, 0.0], [0.4, 0.6, 1.0, 0.0]])  # p == q, and p <= q everywhere
    r = _residual(p, q)
    assert not torch.isnan(r).any()
    assert torch.equal(r, p)
    r = _residual(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.25, 0.0, 0.75]]))
    assert torch.allclose(r, torch.tensor([[1 / 3, 2 / 3, 0.0]]))


def test_no_nan_when_q_equals_p():
    B, Vs = 2000, 4
    g = gen(3)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    N = parents.numel()
    p = torch.softmax(torch.randn(B, N, Vs, generator=g), -1)
    par = parents.clamp(min=0)
    # each node's token drawn from its parent's target distribution (q == p): always accepted
    q = p[:, par].clone()
    tokens = torch.multinomial(q.view(-1, Vs), 1, generator=g).view(B, N)
    q[:, 0] = 0
    d = Draft(tokens, parents.expand(B, N).clone(), q)
    r = verify_sampling_tree(d, p, gen(0))
    assert (r.accept_len == 2).all() and (r.path[:, 1] == 1).all()
    assert ((r.next_token >= 0) & (r.next_token < Vs)).all()
    # unnormalised q = 2p: acceptance 1/2 and the residual is empty -> falls back to p, no NaN
    d2 = Draft(tokens, parents.expand(B, N).clone(), 2 * q)
    r2 = verify_sampling_tree(d2, p, gen(0))
    assert ((r2.next_token >= 0) & (r2.next_token < Vs)).all()
    assert 0 < r2.accept_len.float().mean() < 2
    c = Draft.chain(torch.zeros(B, dtype=torch.long), tokens[:, 1:3], 2 * p[:, :2])
    r3 = verify_sampling_chain(c, p[:, :3], gen(0))
    assert ((r3.next_token >= 0) & (r3.next_token < Vs)).all()


def test_shape_errors():
    d = Draft.chain(torch.tensor([0]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError):
        verify(d, torch.zeros(1, 2, V), SamplingParams())
    dq = Draft.chain(torch.tensor([0]), torch.tensor([[1, 2]]), torch.rand(1, 2, V + 1))
    with pytest.raises(ValueError):
        verify(dq, torch.zeros(1, 3, V), SamplingParams(temperature=1.0), gen())


def test_path_helper_matches_tree_path_to():
    g = gen(4)
    B, N = 32, 9
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
                            for _ in range(B)])
    depths = tree_depths(parents)
    node = torch.randint(0, N, (B,), generator=g)
    assert torch.equal(_path(parents, depths, node, int(depths.max())), path_to(parents, node))


def test_vectorised_tree_bookkeeping_matches_a_node_loop():
    from specfoundry.runtime.tree import ancestor_matrix, tree_depths

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 16, 33, 64):
        parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
                                for _ in range(3)])
        depths = [[0] * n for _ in range(3)]
        anc = torch.zeros(3, n, n, dtype=torch.bool)
        for b in range(3):
            for i in range(n):
                j = i
                while j >= 0:
                    anc[b, i, j] = True
                    j = int(parents[b, j])
                depths[b][i] = int(anc[b, i].sum()) - 1
        assert torch.equal(tree_depths(parents), torch.tensor(depths))
        assert torch.equal(ancestor_matrix(parents), anc)
        for b in range(3):  # one sequence: the list-walking path
            assert torch.equal(tree_depths(parents[b: b + 1]), torch.tensor(depths[b: b + 1]))
            assert torch.equal(ancestor_matrix(parents[b: b + 1]), anc[b: b + 1])


def test_one_sequence_greedy_walk_equals_the_vectorised_verifier():
    """verify() walks one sequence's greedy tree over lists: the vectorised tree verifier's accepted
    length, path (padded to the tree's depth) and next token, ties included, chains and trees alike."""
    from specfoundry.runtime.verify import _greedy_one

    g = gen(7)
    deep = 0
    for trial in range(300):
        n = int(torch.randint(1, 12, (1,), generator=g))
        chain = trial % 3 == 0
        parents = torch.tensor([[-1] + [i - 1 if chain else int(torch.randint(0, i, (1,), generator=g))
                                        for i in range(1, n)]])
        logits = torch.randn(1, n, 3, generator=g).to(torch.bfloat16)  # 3 tokens: many matches and ties
        tokens = torch.randint(0, 3, (1, n), generator=g)
        d = Draft(tokens, parents, None)
        want = verify_greedy_tree(d, logits)
        got = _greedy_one(d, logits)
        same(got, want)
        assert torch.equal(verify(d, logits, SamplingParams(0.0)).path, want.path)
        # its host values (what the generator reads) are the tensors' values, and so are a drafter's
        # host lists when it attached them: the same walk
        accept, path, nxt = got.lists()
        assert (accept, path, nxt) == (int(want.accept_len), [i for i in want.path[0].tolist() if i >= 0],
                                       int(want.next_token))
        assert VerifyResult(want.accept_len, want.path, want.next_token).lists() == (accept, path, nxt)
        hosted = Draft(tokens, parents, None, host=(tokens[0].tolist(), parents[0].tolist()))
        assert _greedy_one(hosted, logits).lists() == (accept, path, nxt)
        deep = max(deep, int(want.accept_len))
    assert deep >= 3


def test_tree_layout_is_the_tensor_bookkeeping_made_once_per_shape():
    """The generator's per-shape layout (depths, ancestor mask, deepest level) equals tree_depths /
    ancestor_matrix of the same parents, and the same shape gives the same (shared) tensors."""
    from specfoundry.runtime.tree import ancestor_matrix, tree_layout

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 4, 9, 40, 70):  # 70: beyond the list-walking helpers' 64 nodes
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        t = torch.tensor([parents])
        lay = tree_layout(parents, torch.device("cpu"))
        assert torch.equal(lay.depths, tree_depths(t)) and lay.depth == tuple(tree_depths(t)[0].tolist())
        assert lay.max_depth == int(tree_depths(t).max())
        if n == 1:
            assert lay.mask is None  # a plain step: no mask
        else:
            assert torch.equal(lay.mask, ancestor_matrix(t))
        assert tree_layout(list(parents), torch.device("cpu")) is lay


def test_host_lists_of_a_draft():
    """Draft.host: checked against the tensors' shape; lists() reads the tensors when no drafter
    attached them; the host-built chain and root equal Draft.chain's tensors."""
    tokens, parents = torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 1]])
    with pytest.raises(ValueError, match="host lists"):
        Draft(tokens, parents, None, host=([5, 6], [-1, 0]))
    with pytest.raises(ValueError, match="host lists"):
        Draft(tokens.expand(2, 3), parents.expand(2, 3), None, host=([5, 6, 7], [-1, 0, 1]))
    assert Draft(tokens, parents).lists() == ([5, 6, 7], [-1, 0, 1])
    with pytest.raises(ValueError, match="one sequence"):
        Draft(tokens.expand(2, 3), parents.expand(2, 3)).lists()
    chain = Draft.chain(torch.tensor([5]), torch.tensor([[6, 7]]))
    hosted = Draft.host_chain([5, 6, 7], torch.device("cpu"))
    assert torch.equal(hosted.tokens, chain.tokens) and torch.equal(hosted.parents, chain.parents)
    assert hosted.host == ([5, 6, 7], [-1, 0, 1])
    root = Draft.root_only(torch.tensor([9]), 9)
    plain = Draft.root_only(torch.tensor([9]))
    assert torch.equal(root.tokens, plain.tokens) and torch.equal(root.parents, plain.parents)
    assert root.host == ([9], [-1]) and plain.host is None
