"""Speculator heads (EAGLE-1, EAGLE-3, Medusa), their checkpoint format and their drafters.

Tiny random float64 Llama targets only. End-to-end losslessness over every registered drafter is
the generator tests' job; here: checkpoint round trips and refusals, draft validity (greedy and
sampling), the heads' KV bookkeeping, tree attention vs a naive recomputation, and a greedy
speculative == plain check through the generator.
"""

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfoundry.runtime.drafters import DRAFTER_REGISTRY, load_drafter
from specfoundry.runtime.drafters.base import DraftContext
from specfoundry.runtime.drafters.eagle import PROMPT_WINDOW, Eagle3Drafter, EagleDrafter
from specfoundry.runtime.drafters.medusa import MedusaDrafter
from specfoundry.runtime.generator import SpeculativeGenerator
from specfoundry.runtime.sampling import SamplingParams, probs_from_logits
from specfoundry.runtime.speculators import (
    SPECULATOR_REGISTRY,
    CheckpointError,
    Eagle3Head,
    EagleHead,
    MedusaHeads,
    TargetMismatchError,
    default_medusa_choices,
    load_speculator,
    save_speculator,
)
from specfoundry.runtime.target import TargetModel
from specfoundry.runtime.tree import tree_depths

V = 64


def make_target(seed=0, vocab=V, layers=4) -> TargetModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    # sharper logits than the default init, so greedy ranks and sampled supports are distinct
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return TargetModel(model, name=f"tiny-{seed}-{vocab}")


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return make_target(0)


def perturbed(module, seed=1):
    """Random values in every floating tensor (zero-init blocks would make round trips trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.1)
    return module


def make_head(kind, target):
    if kind == "eagle":
        return EagleHead.from_target(target)
    if kind == "eagle3":
        return Eagle3Head.from_target(target, draft_token_ids=list(range(V - 1, V - 41, -1)))
    return MedusaHeads.from_target(target, num_heads=3, num_layers=2)


def head_outputs(head, target):
    g = torch.Generator().manual_seed(5)
    if isinstance(head, MedusaHeads):
        return head(torch.randn(1, 3, 32, generator=g, dtype=torch.float64))
    F = len(head.feature_layers)
    feats = torch.randn(1, 5, F, 32, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (1, 5), generator=g)
    return head.compute_logits(head(ids, head.fuse_features(feats)))


KINDS = ["eagle", "eagle3", "medusa"]


# ----------------------------------------------------------------------------- registry


def test_registries_hold_every_type():
    assert SPECULATOR_REGISTRY == {"eagle": EagleHead, "eagle3": Eagle3Head, "medusa": MedusaHeads}
    for kind in KINDS:
        assert kind in DRAFTER_REGISTRY


def test_random_init_leaves_global_rng_alone(target):
    state = torch.random.get_rng_state()
    EagleHead.from_target(target)
    assert torch.equal(state, torch.random.get_rng_state())


def test_eagle3_untrained_head_copies_target_rows(target):
    ids = [5, 9, 2, 40]
    head = Eagle3Head.from_target(target, draft_token_ids=ids)
    assert head.d2t.tolist() == ids
    assert head.t2d.sum() == 4 and bool(head.t2d[ids].all())
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[ids])
    assert head.feature_layers == (2, 2, 1)  # (2, L//2, L-3) for L = 4


def test_unknown_architecture_option_is_refused(target):
    with pytest.raises(ValueError, match="unknown eagle3 architecture option"):
        Eagle3Head.from_target(target, draft_vocab=10)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Head.from_target(target, draft_vocab_size=V + 1)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_round_trip(kind, target, tmp_path):
    head = perturbed(make_head(kind, target))
    path = save_speculator(head, tmp_path / "ckpt", target, training={"steps": 3, "recipe": "x"})
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculator_type"] == kind and cfg["training"] == {"steps": 3, "recipe": "x"}
    assert cfg["target"]["fingerprint"] == target.fingerprint()
    loaded = load_speculator(path, target)
    assert type(loaded) is type(head) and not loaded.training
    assert loaded.architecture == head.architecture
    sd, sd2 = head.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    # shared tensors are the target's, not stored
    assert not any("embed" in k for k in sd)
    if kind == "eagle":
        assert not any(k.startswith("lm_head") for k in sd)
    if kind == "eagle3":
        assert {"d2t", "t2d"} <= sd.keys()
    assert torch.equal(head_outputs(head, target), head_outputs(loaded, target))


def test_load_casts_dtype_but_not_index_buffers(target, tmp_path):
    head = make_head("eagle3", target)
    save_speculator(head, tmp_path / "c", target)
    loaded = load_speculator(tmp_path / "c", target, dtype=torch.float32)
    assert loaded.fc.weight.dtype == torch.float32
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.d2t, head.d2t)


def test_rope_frequencies_stay_float32_under_casts(target):
    head = EagleHead.from_target(target).to(torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16 and head.rotary_emb.inv_freq.dtype == torch.float32


def test_save_replaces_atomically_and_leaves_no_temp(target, tmp_path):
    head = make_head("medusa", target)
    save_speculator(head, tmp_path / "c", target)
    perturbed(head, seed=3)
    save_speculator(head, tmp_path / "c", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_speculator(tmp_path / "c", target).heads[0][0].linear.weight, head.heads[0][0].linear.weight)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        save_speculator(head, other, target)
    assert (other / "todo.txt").read_text() == "keep me"


def test_save_refuses_a_head_built_for_another_target(target, tmp_path):
    head = make_head("eagle", target)
    with pytest.raises(ValueError, match="built for target"):
        save_speculator(head, tmp_path / "c", make_target(seed=7))


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    return {kind: save_speculator(make_head(kind, target), root / kind, target) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_target_fingerprint_is_refused(kind, saved):
    other = make_target(seed=7)  # same shapes, different weights
    with pytest.raises(TargetMismatchError) as exc:
        load_speculator(saved[kind], other)
    msg = str(exc.value)
    assert "trained for target 'tiny-0-64'" in msg and "given target is 'tiny-7-64'" in msg
    assert "fingerprint" in msg and "config.json" in msg


def test_wrong_target_vocab_is_refused(saved):
    other = make_target(seed=0, vocab=80)
    with pytest.raises(TargetMismatchError, match=r"vocab_size=64.*vocab_size=80.*differ in vocab_size") as exc:
        load_speculator(saved["eagle3"], other)
    assert exc.value.key == "target.vocab_size"
    with pytest.raises(TargetMismatchError, match="num_layers"):
        load_speculator(saved["medusa"], make_target(seed=0, layers=3))


def _edit(src, dst, fn):
    shutil.copytree(src, dst)
    cfg_file = dst / "config.json"
    cfg = json.loads(cfg_file.read_text())
    out = fn(cfg)
    cfg_file.write_text(out if isinstance(out, str) else json.dumps(cfg))
    return dst


def _set(path, value):
    def fn(cfg):
        node = cfg
        *parents, last = path
        for p in parents:
            node = node[p]
        node[last] = value

    return fn


def _drop(path):
    def fn(cfg):
        node = cfg
        *parents, last = path
        for p in parents:
            node = node[p]
        del node[last]

    return fn


MALFORMED = [
    ("unknown top key", _set(["extra"], 1), "extra", "unknown key"),
    ("unknown architecture key", _set(["architecture", "num_experts"], 2), "architecture.num_experts", "unknown key"),
    ("missing key", _drop(["target", "fingerprint"]), "target.fingerprint", "missing"),
    ("missing architecture key", _drop(["architecture", "head_dim"]), "architecture.head_dim", "missing"),
    ("wrong type", _set(["architecture", "hidden_size"], "32"), "architecture.hidden_size", "expected int, got string"),
    ("bool is not int", _set(["format_version"], True), "format_version", "expected int, got bool"),
    ("wrong list type", _set(["target", "feature_layers"], [4.5]), "target.feature_layers", "expected list of int"),
    ("unknown type", _set(["speculator_type"], "hydra"), "speculator_type", "unknown type 'hydra'"),
    ("future version", _set(["format_version"], 2), "format_version", "reads version 1"),
    ("wrong format", _set(["format"], "hf"), "format", "expected 'specfoundry.speculator'"),
    ("training not a dict", _set(["training"], [1]), "training", "expected object"),
    ("bad json", lambda cfg: '{"format": "specfoundry.speculator",', None, "not valid JSON"),
    ("not an object", lambda cfg: "[1, 2]", None, "JSON object"),
]


@pytest.mark.parametrize("name,edit,key,words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_config_is_one_clear_error(name, edit, key, words, saved, target, tmp_path):
    bad = _edit(saved["eagle3"], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as exc:
        load_speculator(bad, target)
    err = exc.value
    assert isinstance(err, ValueError) and not isinstance(err, TargetMismatchError)
    assert err.key == key
    assert str(bad / "config.json") in str(err) and words in str(err)
    if key:
        assert repr(key) in str(err)
    assert err.__cause__ is None  # one error, not a chain


def test_architecture_that_does_not_fit_is_refused(saved, target, tmp_path):
    bad = _edit(saved["eagle3"], tmp_path / "bad", _set(["architecture", "draft_vocab_size"], 1000))
    with pytest.raises(CheckpointError, match="draft_vocab_size") as exc:
        load_speculator(bad, target)
    assert exc.value.key == "architecture.draft_vocab_size"
    bad2 = _edit(saved["eagle"], tmp_path / "bad2", _set(["target", "feature_layers"], [3]))
    with pytest.raises(CheckpointError, match="feature_layers"):
        load_speculator(bad2, target)


def test_weights_file_problems_name_the_tensor(saved, target, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _edit(saved["eagle3"], tmp_path / "bad", lambda cfg: json.dumps(cfg))
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight.*missing tensor"):
        load_speculator(bad, target)
    tensors["fc.weight"] = torch.zeros(32, 96)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="extra.weight.*unexpected tensor"):
        load_speculator(bad, target)
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_speculator(bad, target)


# ----------------------------------------------------------------------------- drafters


def check_draft(draft, ctx, vocab=V):
    B, N = draft.tokens.shape
    assert B == 1 and draft.parents.shape == (1, N)
    assert draft.tokens[0, 0] == ctx.tokens[0, -1]
    assert N <= ctx.max_nodes
    par = draft.parents[0]
    assert par[0] == -1
    assert bool((par[1:] >= 0).all()) and bool((par[1:] < torch.arange(1, N)).all())
    assert int(tree_depths(draft.parents).max()) <= ctx.max_depth
    assert bool(((draft.tokens >= 0) & (draft.tokens < vocab)).all())
    # siblings are distinct tokens (top-k in greedy mode, without replacement when sampling)
    for p in set(par[1:].tolist()):
        kids = draft.tokens[0, 1:][par[1:] == p]
        assert kids.unique().numel() == kids.numel()
    if ctx.sampling.greedy or N == 1:
        return
    q = draft.q
    assert q is not None and q.shape == (1, N, vocab)
    assert bool((q[0, 1:] >= 0).all())
    assert torch.allclose(q[0, 1:].sum(-1).double(), torch.ones(N - 1, dtype=torch.float64), atol=1e-5)
    drawn = q[0, torch.arange(1, N), draft.tokens[0, 1:]]
    assert bool((drawn > 0).all())
    # a later sibling's q is the earlier sibling's q without that token, renormalised
    for i in range(2, N):
        earlier = [j for j in range(1, i) if par[j] == par[i]]
        if earlier:
            j = earlier[-1]
            expect = q[0, j].clone()
            expect[draft.tokens[0, j]] = 0
            assert torch.allclose(q[0, i], expect / expect.sum(), atol=1e-6)


class Checked:
    """Wraps a drafter: validates every draft and the head cache after every propose."""

    def __init__(self, inner):
        self.inner = inner
        self.feature_layers = inner.feature_layers
        self.default_depth, self.default_nodes = inner.default_depth, inner.default_nodes
        self.proposals = 0

    def begin(self, prompt_ids, features):
        self.inner.begin(prompt_ids, features)

    def commit(self, new_tokens, features):
        self.inner.commit(new_tokens, features)

    def propose(self, ctx):
        draft = self.inner.propose(ctx)
        check_draft(draft, ctx)
        cache = getattr(self.inner, "cache", None)
        if cache is not None:  # EAGLE: back to the committed pairs (features known for tokens[:-1])
            assert cache.length == ctx.tokens.shape[1] - 1 and not cache._pending
            assert cache.capacity >= cache.length  # a static cache: entries past length are dead
        self.proposals += 1
        return draft


DRAFTER_CASES = [
    ("eagle", {}),
    ("eagle", {"tree": "chain", "depth": 4}),
    ("eagle3", {"architecture": {"draft_vocab_size": 40}, "top_k": 4, "total_tokens": 12}),
    ("medusa", {}),
    ("medusa", {"choices": [[0], [1], [0, 0], [0, 1], [2, 0, 0]], "architecture": {"num_heads": 3}}),
]


@pytest.mark.parametrize("kind,options", DRAFTER_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(DRAFTER_CASES)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_are_valid_through_the_generator(kind, options, temperature, target):
    drafter = Checked(load_drafter(kind, target, **options))
    gen = SpeculativeGenerator(target, drafter, adaptive=False)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    out = gen.generate(prompt_ids=prompt, max_new_tokens=12, temperature=temperature, top_p=0.95 if temperature else None)
    assert len(out.token_ids) == 12 and drafter.proposals >= 1
    if temperature == 0.0:
        plain = SpeculativeGenerator(target, None).generate(prompt_ids=prompt, max_new_tokens=12, speculate=False)
        assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_budget_limits_are_honoured(kind, target):
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(4))
    drafter = load_drafter(kind, target)
    cache = target.new_cache()
    out = target.forward(prompt[:, :-1], cache, feature_layers=drafter.feature_layers)
    drafter.begin(prompt, out.features)
    for sampling in (SamplingParams(0.0), SamplingParams(1.0, top_k=2), SamplingParams(0.7)):
        for depth, nodes in ((1, 2), (2, 4), (3, 7), (5, 32), (5, 1), (0, 8)):
            ctx = DraftContext(prompt, sampling, depth, nodes, torch.Generator().manual_seed(0))
            draft = drafter.propose(ctx)
            check_draft(draft, ctx)
            if depth and nodes > 1:
                assert draft.num_nodes > 1
            if sampling.top_k == 2:  # q has two non-zero entries: never more than two siblings
                counts = torch.bincount(draft.parents[0, 1:], minlength=draft.num_nodes)
                assert int(counts.max()) <= 2


def test_chain_mode_is_a_chain(target):
    drafter = load_drafter("eagle", target, tree="chain", depth=3)
    assert drafter.default_nodes == 4
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(1))
    out = target.forward(prompt[:, :-1], target.new_cache(), feature_layers=drafter.feature_layers)
    drafter.begin(prompt, out.features)
    for sampling in (SamplingParams(0.0), SamplingParams(1.0)):
        draft = drafter.propose(DraftContext(prompt, sampling, 5, 10, torch.Generator().manual_seed(0)))
        assert draft.parents[0].tolist() == [-1, 0, 1, 2]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_chain_fast_path_equals_the_tree_search(kind, target):
    """A greedy chain (node budget = depth) skips the tree search: it drafts the same tokens the
    search with top_k=1 drafts, at every step of a generation (commits in between)."""
    fast = load_drafter(kind, target, tree="chain", depth=4)
    slow = load_drafter(kind, target, tree="chain", depth=4)
    slow._grow_chain = lambda root, depth, ctx: slow._grow_greedy(root, depth, depth)  # the search
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (1, 7), generator=g)
    out = target.forward(ids[:, :-1], target.new_cache(), feature_layers=fast.feature_layers)
    for d in (fast, slow):
        d.begin(ids, out.features)
    for step in range(6):
        a = fast.propose(DraftContext(ids, SamplingParams(0.0), 4, 5))
        b = slow.propose(DraftContext(ids, SamplingParams(0.0), 4, 5))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents), step
        n = 1 + step % 3
        new = torch.cat([a.tokens[0, 1:n], torch.randint(0, V, (1,), generator=g)]).view(1, -1)
        feats = torch.randn(1, new.shape[1], *out.features.shape[2:], generator=g, dtype=out.features.dtype)
        for d in (fast, slow):
            d.commit(new, feats)
        ids = torch.cat([ids, new], dim=1)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_head_runs_only_the_prompts_last_pairs(kind, target):
    """prompt_window=5 over a 20-token prompt: the head's cache holds 5 pairs after the first
    proposal, and every draft (commits in between) is the one a drafter given only the prompt's
    last 6 tokens proposes; 0 runs them all, a negative or non-integer window is refused."""
    assert load_drafter(kind, target).prompt_window == PROMPT_WINDOW
    for bad in (-1, 2.0, "8"):
        with pytest.raises(ValueError, match="prompt_window"):
            load_drafter(kind, target, prompt_window=bad)
    windowed = load_drafter(kind, target, prompt_window=5)
    tail, everything = load_drafter(kind, target), load_drafter(kind, target, prompt_window=0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (1, 20), generator=g)
    feats = target.forward(ids[:, :-1], target.new_cache(), feature_layers=windowed.feature_layers).features
    windowed.begin(ids, feats)
    everything.begin(ids, feats)
    tail.begin(ids[:, -6:], feats[:, -5:])
    short = ids[:, -6:]
    for step in range(5):
        a = windowed.propose(DraftContext(ids, SamplingParams(0.0), 3, 6))
        b = tail.propose(DraftContext(short, SamplingParams(0.0), 3, 6))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents), step
        everything.propose(DraftContext(ids, SamplingParams(0.0), 3, 6))
        if step == 0:
            assert windowed.cache.length == 5 and everything.cache.length == 19
        new = torch.cat([a.tokens[0, 1:1 + step % 3], torch.randint(0, V, (1,), generator=g)]).view(1, -1)
        f = torch.randn(1, new.shape[1], *feats.shape[2:], generator=g, dtype=feats.dtype)
        for d in (windowed, tail, everything):
            d.commit(new, f)
        ids, short = torch.cat([ids, new], dim=1), torch.cat([short, new], dim=1)


def naive_hidden(head, feats, prompt, path_tokens):
    """Head output for the last pair, recomputed from scratch along one path (no cache, causal)."""
    fused = head.fuse_features(feats)  # pairs (feature_t, token_{t+1})
    ids = prompt[:, 1:]
    hidden = fused
    h = head(ids, hidden)[:, -1:]
    for tok in path_tokens:
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        hidden = torch.cat([hidden, h], dim=1)
        h = head(ids, hidden)[:, -1:]
    return h[:, 0]


def path_of(draft, i):
    par, toks, path = draft.parents[0].tolist(), draft.tokens[0].tolist(), []
    while i > 0:
        path.append(toks[i])
        i = par[i]
    return path[::-1]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_tree_attention_matches_naive_recomputation(kind, target):
    """Every node's token is among the top-k of its parent's logits recomputed without a
    cache or tree mask; in sampling mode the first child's q is exactly the processed draft
    distribution at its parent."""
    head = perturbed(make_head(kind, target), seed=2)
    drafter = (EagleDrafter if kind == "eagle" else Eagle3Drafter)(head, top_k=3, depth=3, total_tokens=14)
    prompt = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(6))
    feats = target.forward(prompt[:, :-1], target.new_cache(), feature_layers=drafter.feature_layers).features
    drafter.begin(prompt, feats)
    d2t = head.draft_to_target
    with torch.inference_mode():
        greedy = drafter.propose(DraftContext(prompt, SamplingParams(0.0), 3, 14))
        assert greedy.num_nodes == 14 and int(greedy.depths.max()) == 3
        for i in range(1, greedy.num_nodes):
            parent_path = path_of(greedy, int(greedy.parents[0, i]))
            logits = head.compute_logits(naive_hidden(head, feats, prompt, parent_path))
            top = logits.topk(3, dim=-1).indices[0]
            top = top if d2t is None else d2t[top]
            assert int(greedy.tokens[0, i]) in top.tolist(), i
        sp = SamplingParams(0.8)
        sampled = drafter.propose(DraftContext(prompt, sp, 3, 14, torch.Generator().manual_seed(1)))
        par = sampled.parents[0].tolist()
        for i in range(1, sampled.num_nodes):
            if par.index(par[i], 1) != i:
                continue  # only first children carry the undiminished distribution
            q = probs_from_logits(head.compute_logits(naive_hidden(head, feats, prompt, path_of(sampled, par[i]))), sp)[0]
            if d2t is not None:
                q = torch.zeros(V, dtype=q.dtype).index_copy(0, d2t, q)
            assert torch.allclose(sampled.q[0, i], q, atol=1e-10), i


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_chain_reads_the_naive_hidden_states(kind, target):
    """The chain fast path's head states at every depth equal a recomputation without a cache
    along the drafted path, and each draft is the argmax of its logits."""
    head = perturbed(make_head(kind, target), seed=3)
    drafter = (EagleDrafter if kind == "eagle" else Eagle3Drafter)(head, tree="chain", depth=4)
    prompt = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(7))
    feats = target.forward(prompt[:, :-1], target.new_cache(), feature_layers=drafter.feature_layers).features
    drafter.begin(prompt, feats)
    seen, real = [], head.compute_logits

    def recording(h):
        seen.append(h.detach().clone())
        return real(h)

    d2t = head.draft_to_target
    with torch.inference_mode():
        head.compute_logits = recording
        draft = drafter.propose(DraftContext(prompt, SamplingParams(0.0), 4, 5))
        del head.compute_logits
        assert draft.parents[0].tolist() == [-1, 0, 1, 2, 3] and len(seen) == 4
        path = draft.tokens[0, 1:].tolist()
        for d, h in enumerate(seen):
            naive = naive_hidden(head, feats, prompt, path[:d])
            torch.testing.assert_close(h.view(-1), naive.view(-1), rtol=1e-9, atol=1e-9)
            top = int(real(naive).argmax())
            assert path[d] == (top if d2t is None else int(d2t[top]))


def test_medusa_greedy_tokens_follow_head_ranks(target):
    heads = perturbed(make_head("medusa", target), seed=4)
    choices = [[0], [1], [0, 0], [0, 2], [1, 0], [0, 0, 1]]
    drafter = MedusaDrafter(heads, choices=choices)
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(2))
    feats = target.forward(prompt[:, :-1], target.new_cache(), feature_layers=drafter.feature_layers).features
    drafter.begin(prompt, feats)
    draft = drafter.propose(DraftContext(prompt, SamplingParams(0.0), 3, 10))
    with torch.inference_mode():
        logits = heads(feats[:, -1, 0])[0]  # [K, V]
    ranked = logits.argsort(-1, descending=True)
    for i, path in enumerate(drafter.paths, start=1):
        assert int(draft.tokens[0, i]) == int(ranked[len(path) - 1, path[-1]])
    short = drafter.propose(DraftContext(prompt, SamplingParams(0.0), 1, 10))
    assert short.num_nodes == 3  # the two depth-1 choices


def test_medusa_blocks_and_heads_are_distinct_modules(target):
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=2)
    blocks = [blk for head in heads.heads for blk in list(head)[:-1]]
    assert len(blocks) == 6 and len({id(b) for b in blocks}) == 6
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 3 * (2 * 2 + 1)
    with torch.no_grad():
        heads.heads[0][0].linear.weight.fill_(1.0)
    assert float(heads.heads[0][1].linear.weight.detach().abs().sum()) == 0.0
    assert float(heads.heads[1][0].linear.weight.detach().abs().sum()) == 0.0
    # untrained: zero blocks make every head the target's lm_head on the feature
    fresh = MedusaHeads.from_target(target, num_heads=2)
    x = torch.randn(1, 32, dtype=torch.float64)
    with torch.inference_mode():
        assert torch.allclose(fresh(x)[:, 1], target.lm_head(x))


def test_default_medusa_choices_are_closed():
    for K in (1, 3, 5):
        choices = default_medusa_choices(K, 24)
        assert len(choices) == (10 if K == 1 else 24) and max(len(c) for c in choices) <= K
        got = {tuple(c) for c in choices}
        for c in got:
            assert len(c) == 1 or c[:-1] in got  # prefixes
            assert c[-1] == 0 or c[:-1] + (c[-1] - 1,) in got  # lower sibling ranks


def test_checkpoint_loads_through_load_drafter(saved, target):
    drafter = load_drafter(str(saved["eagle3"]), target, top_k=3, total_tokens=10)
    assert isinstance(drafter, Eagle3Drafter) and drafter.default_nodes == 10
    with pytest.raises(ValueError, match="holds a 'eagle3' speculator"):
        DRAFTER_REGISTRY["eagle"](saved["eagle3"], target)
