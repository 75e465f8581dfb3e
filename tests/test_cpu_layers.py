"""All decoder layers of one sequence's step in one C call (runtime/cpu_layers.py): the engine's
decode and verification forwards and the EAGLE heads' drafting layer on it equal the op-by-op
forward within bf16 rounding (logits, requested features, the K/V written), with Q/K/V biases
(Qwen2) and tree masks, on the AVX-512 BF16 products and on the AMX tiles; greedy speculation stays the
plain output through it; bad inputs are refused. Not run on CPUs without avx512_bf16 (the engine keeps
the op-by-op forward there); the AMX cases only on CPUs with AMX."""

import pytest
import torch
from tiny_models import assert_greedy_speculation_is_plain, tiny_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from specfoundry.runtime import cpu_gemv, cpu_layers, load_drafter
from specfoundry.runtime.drafters.base import DraftContext
from specfoundry.runtime.engine import KERNELS_ENV, LlamaEngine, kernel_for
from specfoundry.runtime.models import wrap_target
from specfoundry.runtime.sampling import SamplingParams
from specfoundry.runtime.tree import ancestor_matrix, tree_depths

pytestmark = pytest.mark.skipif(not cpu_layers.available(),
                                reason=f"layer kernel unavailable: {cpu_layers.unavailable_reason()}")

FEW_ROW = ("avx512bf16", "avx512bf16", "avx512bf16")
AMX = ("amx", "amx", "amx")
needs_amx = pytest.mark.skipif(not cpu_layers.available(amx=True), reason=f"the layer kernel on AMX is unavailable: "
                               f"{cpu_layers.unavailable_reason(amx=True)}")


def _target(arch: str = "llama", seed: int = 0, init_std: float = 0.02, kernels: tuple[str, ...] = FEW_ROW):
    if arch == "llama":
        target = tiny_llama(seed, vocab=96, hidden=128, layers=3, dtype=torch.bfloat16, init_std=init_std)
    else:  # Qwen2: biases on Q/K/V
        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=init_std, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        with torch.no_grad():  # HF initialises biases to zero: make them matter
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0, 0.5)
        target = wrap_target(model, name="tiny-qwen2", backend="engine")
    target.engine = LlamaEngine(target.model, kernels=kernels)
    return target


def _spy(monkeypatch):
    calls = []
    real = cpu_layers.run_layers
    monkeypatch.setattr(cpu_layers, "run_layers", lambda table, x, *a, **k: calls.append(x.shape[1]) or real(table, x, *a, **k))
    return calls


@pytest.mark.parametrize("kernels", [FEW_ROW, pytest.param(AMX, marks=needs_amx)], ids=["avx512bf16", "amx"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", ["one", "chain", "tree"])
def test_engine_step_equals_the_op_by_op_forward(monkeypatch, arch, shape, kernels):
    target = _target(arch, kernels=kernels)
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 96, (1, 40), generator=g)
    n = {"one": 1, "chain": 3, "tree": 7}[shape]
    toks = torch.randint(0, 96, (1, n), generator=g)
    if shape == "tree":
        parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 4]])
        pos, mask = 40 + tree_depths(parents), ancestor_matrix(parents)
    else:
        pos, mask = 40 + torch.arange(n).view(1, n), None
    outs = {}
    for on in (False, True):
        target.engine.use_layer_kernel = on
        cache = target.new_cache(capacity=64)
        target.forward(prefix, cache)
        cache.commit()
        out = target.forward(toks, cache, position_ids=pos, tree_mask=mask, feature_layers=(0, 2, 3))
        outs[on] = (out.logits.float(), out.features.float(), cache.kv[..., 40: 40 + n, :].float())
    # the kernel ran the step, and only with it on; the 40-token prefill too on the AMX products (up to
    # MAX_TOKENS_AMX tokens there), not on AVX-512 BF16's
    assert calls == ([40, n] if kernels == AMX else [n])
    (la, fa, ka), (lb, fb, kb) = outs[False], outs[True]
    # bf16 rounding: a value may differ in its last bit (the norm's sum order, SiLU's exponential)
    assert (la - lb).abs().max() <= 0.02 * la.abs().max()
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() >= 0.85
    assert torch.equal(fa[:, :, 0], fb[:, :, 0])  # layer 0's input: the embedding itself
    assert (fa - fb).abs().max() <= 0.02 * fa.abs().max()
    assert (ka - kb).abs().max() <= 0.02 * ka.abs().max()


@pytest.fixture(params=["vdpbf16ps", "fma"])
def products_path(request):
    """The layer kernel's few-row products with every pass of several rows on one path (whichever
    cpu_gemv.fma_rows chose here, restored after); the FMA path only where it gives vdpbf16ps's bits."""
    if request.param == "fma" and not cpu_gemv.fma_exact():
        pytest.skip("the FMA path does not give vdpbf16ps's bits on this CPU (cpu_gemv.fma_rows never uses it here)")
    lib = cpu_layers._load()[0]
    cpu_gemv.set_fma_rows(lib, range(2, 9) if request.param == "fma" else ())
    yield request.param
    cpu_gemv.set_fma_rows(lib, cpu_gemv.fma_rows())


@pytest.mark.skipif(not cpu_gemv.fma_exact(), reason="the FMA path does not give vdpbf16ps's bits on this CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_verification_on_either_products_path_is_the_same_bits(arch):
    # the path a pass of rows takes is chosen by speed (cpu_gemv.fma_rows): logits, features and the
    # K/V written must not depend on it
    target = _target(arch)
    lib = cpu_layers._load()[0]
    g = torch.Generator().manual_seed(2)
    prefix, toks = torch.randint(0, 96, (1, 40), generator=g), torch.randint(0, 96, (1, 7), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 4]])
    outs = []
    try:
        for rows in ((), range(2, 9)):
            cpu_gemv.set_fma_rows(lib, rows)
            cache = target.new_cache(capacity=64)
            target.forward(prefix, cache)
            cache.commit()
            out = target.forward(toks, cache, position_ids=40 + tree_depths(parents), tree_mask=ancestor_matrix(parents),
                                 feature_layers=(0, 2, 3))
            outs.append((out.logits, out.features, cache.kv[..., 40:47, :].clone()))
    finally:
        cpu_gemv.set_fma_rows(lib, cpu_gemv.fma_rows())
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not cpu_gemv.fma_exact(), reason="the FMA path does not give vdpbf16ps's bits on this CPU")
@pytest.mark.parametrize("layer_kernel", [True, False], ids=["layer-kernel", "op-by-op"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_row_steps_with_the_fma_path_for_streamed_weights_are_the_same_bits(arch, layer_kernel):
    # the engine's fma2 (measured: LlamaEngine._two_rows_on_fma) moves 2-row passes of the layers' products
    # and the LM head to FMAs: a chain of one draft, and a 10-node tree (a pass of 8 rows, then one of 2);
    # op by op as the serving batch's forward runs them
    target = _target(arch)
    target.engine.use_layer_kernel = layer_kernel
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 96, (1, 40), generator=g)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 4, 3, 3, 8]])
    steps = [(torch.randint(0, 96, (1, 2), generator=g), 40 + torch.arange(2).view(1, 2), None),
             (torch.randint(0, 96, (1, 10), generator=g), 40 + tree_depths(parents), ancestor_matrix(parents))]
    outs = {}
    try:
        for on in (False, True):
            target.engine.fma2 = on
            for j, (toks, pos, mask) in enumerate(steps):
                cache = target.new_cache(capacity=64)
                target.forward(prefix, cache)
                cache.commit()
                out = target.forward(toks, cache, position_ids=pos, tree_mask=mask, feature_layers=(0, 2, 3))
                outs[on, j] = (out.logits, out.features, cache.kv[..., 40: 40 + toks.shape[1], :].clone())
    finally:
        target.engine.fma2 = False
    for j in range(len(steps)):
        for a, b in zip(outs[False, j], outs[True, j]):
            assert torch.equal(a, b), j


def test_greedy_speculation_equals_plain_through_it(monkeypatch, products_path):
    target = _target()
    calls = _spy(monkeypatch)
    # token for token, trees included: a tree's nodes sit at other cache positions than after the
    # commit, and the attention sums them in a plain step's order (no bf16 near-ties to excuse)
    assert_greedy_speculation_is_plain(target, [("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3}),
                                                ("eagle3", {"depth": 3, "total_tokens": 8})], vocab=96)
    assert 1 in calls and max(calls) > 1  # plain steps, verifications and head steps ran on it


def _row_major(kt: torch.Tensor) -> torch.Tensor:
    """The cache's transposed keys ``[L, hkv, cap, D]`` (per head ``[cap/16][D/2][16][2]``) as K's rows."""
    L, h, cap, D = kt.shape
    return kt.view(L, h, cap // 16, D // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(L, h, cap, D)


def test_the_transposed_keys_follow_the_cache(monkeypatch):
    """The kernel's scores read K stored transposed per 16-column block; that copy follows K through a
    prefill on another path, plain steps, a tree whose kept entries move, a crop refilled on another
    path, a regrown cache,
    and a step on it gives the logits of a step on a fresh cache (where the whole copy is written anew)."""
    target = _target()
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(5)
    cache = target.new_cache(capacity=48)
    target.forward(torch.randint(0, 96, (1, 30), generator=g), cache)  # 30 tokens: the many-row path
    cache.commit()
    assert cache._kt.kt is None and not calls

    def step(n, keep=None, tree=None):
        past = cache.length
        toks = torch.randint(0, 96, (1, n), generator=g)
        pos = None if tree is None else past + tree_depths(tree)
        out = target.forward(toks, cache, position_ids=pos, tree_mask=None if tree is None else ancestor_matrix(tree))
        kt, held = cache.transposed_keys()
        assert held == past and cache.capacity <= kt.shape[2]  # the committed columns, all of them
        k = cache.kv[:, 0, 0]
        assert torch.equal(_row_major(kt)[:, :, : past + n], k[:, :, : past + n])  # the new ones too
        cache.commit(keep)
        return toks, out

    for _ in range(3):
        step(1)
    step(5, keep=[0, 2, 4], tree=torch.tensor([[-1, 0, 0, 2, 2]]))  # kept entries 2 and 4 move
    step(1)
    cache.crop(cache.length - 4)
    target.forward(torch.randint(0, 96, (1, 9), generator=g), cache)  # the many-row path over the cropped columns
    cache.commit()
    step(3)
    while cache.capacity == 48:  # past the capacity: K is copied into a larger tensor, the copy restarts
        step(8)
    toks, out = step(4)
    assert len(calls) == 8 and all(1 <= n <= 8 for n in calls)
    fresh = target.new_cache(capacity=cache.capacity)
    prefix = cache.length - 4
    with torch.inference_mode():
        fresh.kv[..., :prefix, :] = cache.kv[..., :prefix, :]
    fresh.length = prefix
    again = target.forward(toks, fresh)
    assert torch.equal(out.logits, again.logits)
    with pytest.raises(ValueError, match="one CPU bf16 sequence"):
        target.new_cache(batch=2, capacity=8).transposed_keys()


def test_eagle3_head_step_equals_the_op_by_op_step(monkeypatch):
    from specfoundry.runtime.speculators.eagle import _EagleBase

    target = _target()
    head = load_drafter("eagle3", target=target, tree="chain", depth=3).head
    with torch.no_grad():  # an untrained head's attention barely moves its output: make it count
        for lin, f in (("q_proj", 4), ("k_proj", 4), ("v_proj", 8), ("o_proj", 8)):
            getattr(head.layer.self_attn, lin).weight.mul_(f)
    torch.manual_seed(0)
    feats = torch.randn(1, 30, len(head.feature_layers), 128).to(torch.bfloat16)
    ids = torch.randint(0, 96, (1, 34))
    real = _EagleBase._layer_table
    outs = {}
    for on in (False, True):
        tables = []
        monkeypatch.setattr(_EagleBase, "_layer_table", lambda *a: tables.append(real(*a)) or tables[-1] if on else None)
        cache = head.new_cache(64)
        x = head.step(ids[:, 1:31], head.fuse_features(feats), cache)[:, -1:]  # 30 pairs: the op-by-op path
        cache.commit()
        steps = [x]
        for t in range(2):  # a chain's one-token steps, then three tokens at once
            x = head.step(ids[:, 31 + t: 32 + t], x, cache)
            cache.commit()
            steps.append(x)
        steps.append(head.step(ids[:, 31:34], torch.cat(steps[:3], 1), cache))
        cache.commit()
        # a tree's next depth: 2 nodes whose block covers the 3 drafts before them (k = 5 > n = 2)
        block = torch.tensor([[[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]]], dtype=torch.bool)
        steps.append(head.step(ids[:, 32:34], steps[-1][:, :2], cache, position_ids=torch.tensor([[33, 33]]), block=block))
        outs[on] = torch.cat(steps, 1).float()
        if on:
            assert sum(t is not None for t in tables) == 4  # the four short steps took the kernel
    a, b = outs[False], outs[True]
    assert torch.equal(a[:, 0], b[:, 0])
    assert (a - b).abs().max() <= 0.02 * a.abs().max()


def _eagle3_chain(target, depth: int = 3, **options):
    drafter = load_drafter("eagle3", target=target, **({"tree": "chain", "depth": depth} | options))
    head = drafter.head
    with torch.no_grad():  # as above: make the head's attention count
        for lin, f in (("q_proj", 4), ("k_proj", 4), ("v_proj", 8), ("o_proj", 8)):
            getattr(head.layer.self_attn, lin).weight.mul_(f)
    # a draft vocabulary that is not the identity: the drafts go through d2t
    head.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(5)))
    return drafter


def _drafts_and_outputs(target, drafter, prompts, lookup: bool = False, temperature: float = 0.0):
    from specfoundry.runtime import SpeculativeGenerator
    from specfoundry.runtime.drafters.lookup import with_lookup

    proposed, real = [], drafter.propose

    def propose(ctx):
        draft = real(ctx)
        tokens, parents = draft.tokens.tolist()[0], draft.parents.tolist()[0]
        # host lists a drafter attaches (the C call's, the lookup's) are its tensors' values
        assert draft.host is None or draft.host == (tokens, parents)
        # (the one-call drafting's q spans the draft vocabulary: compared over the target's)
        proposed.append((tokens, parents, draft.target_q(target.vocab_size), draft.host is not None))
        return draft

    drafter.propose = propose
    gen = SpeculativeGenerator(target, with_lookup(drafter, 2) if lookup else drafter, adaptive=False)
    outs = [gen.generate(prompt_ids=p, max_new_tokens=24, stop_at_eos=False, temperature=temperature, seed=i).token_ids
            for i, p in enumerate(prompts)]
    drafter.propose = real
    return proposed, outs


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("case", ["chain", "chain+lookup", "tree", "wide tree", "deep tree", "chain T=1", "tree T=1",
                                  "chain T=1 draft temperature 0.6"])
def test_fused_eagle3_drafting_equals_the_step_by_step_drafting(monkeypatch, case, weights):
    """One C call per proposal (the queued pairs, and a greedy chain) drafts what fuse_features, step and
    compute_logits do one by one, bit for bit (a sampled chain: the same draws, q within fp32 rounding;
    a greedy tree: the same EAGLE-2 search); more than MAX_TOKENS queued pairs (the prompt, a long
    accepted lookup) take the step-by-step path. Sampled trees run only the queue in it. With the head's
    int8 drafting weights both paths run the int8 products (the C call's table and its fc / lm head too)."""
    from specfoundry.runtime.speculators.eagle import Eagle3Head

    target = _target(init_std=0.5)
    trees = {"tree": {"tree": "dynamic", "top_k": 2, "total_tokens": 6}, "tree T=1": {"tree": "dynamic", "top_k": 2, "total_tokens": 6, "sampled_trees": True},
             "wide tree": {"tree": "dynamic", "top_k": 5, "total_tokens": 12, "depth": 4},
             "deep tree": {"tree": "dynamic", "top_k": 8, "total_tokens": 40, "depth": 5},
             "chain T=1 draft temperature 0.6": {"draft_temperature": 0.6}}
    drafter = _eagle3_chain(target, head_weights=weights, **trees.get(case, {}))
    assert drafter.head._linears.int8 == (weights == "int8")
    lookup, temperature = case == "chain+lookup", 1.0 if "T=1" in case else 0.0
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (6,), generator=g).tolist() * 3 for _ in range(3)]
    calls = []
    real = Eagle3Head.fused_draft

    def spy(self, ids, *a):
        out = real(self, ids, *a)
        calls.append((0 if ids is None else ids.shape[1], out is not None))
        return out

    monkeypatch.setattr(Eagle3Head, "fused_draft", spy)
    fused = _drafts_and_outputs(target, drafter, prompts, lookup, temperature)
    # the one-call drafting attached its lists (a sampled tree is drafted step by step: none)
    assert any(hosted for *_, hosted in fused[0]) == (case != "tree T=1")
    # it ran on every short queue, never on a longer one (the prompts: 18 pairs)
    assert all(ran == (n <= cpu_layers.MAX_TOKENS) for n, ran in calls) and sum(ran for _, ran in calls) > 10
    monkeypatch.setattr(Eagle3Head, "fused_draft", lambda *a: None)
    step_by_step = _drafts_and_outputs(target, drafter, prompts, lookup, temperature)
    assert fused[1] == step_by_step[1]
    assert len(fused[0]) == len(step_by_step[0])
    for (tok_a, par_a, q_a, _), (tok_b, par_b, q_b, _) in zip(fused[0], step_by_step[0]):
        assert tok_a == tok_b and par_a == par_b
        # a sampled chain's q: the C softmax (its own exponential) within fp32 rounding of PyTorch's
        assert (q_a is None) == (q_b is None) and (q_a is None or torch.allclose(q_a, q_b, rtol=1e-5, atol=1e-8))
    assert any(len(tok) >= 4 for tok, *_ in fused[0])  # chains / trees were drafted (root + 3 or more)
    assert (fused[0][-1][2] is not None) == (temperature > 0)
    plan = drafter.head.draft_plan(drafter.cache)  # the C call read the weights in the format asked for
    assert plan[1]["lmw"].dtype == (torch.uint8 if weights == "int8" else torch.bfloat16)
    assert int(plan[0][0, 7]) == (weights == "int8")


def test_fused_eagle3_drafting_steps_aside_where_it_does_not_apply():
    target = _target()
    drafter = _eagle3_chain(target, depth=2)
    head = drafter.head
    drafter.begin(torch.tensor([[1, 2, 3, 4]]), torch.randn(1, 3, 3, 128).bfloat16())
    ids, feats = torch.cat(drafter._queue_ids, 1), torch.cat(drafter._queue_features, 1)
    assert head.fused_draft(ids, feats, None, 2, head.new_cache(64)) is not None
    head.norm.variance_epsilon = 1e-3  # norms of different epsilons: one eps in C would be wrong
    assert head.fused_draft(ids, feats, None, 2, head.new_cache(64)) is None
    head.norm.variance_epsilon = head.layer.hidden_norm.variance_epsilon
    assert head.fused_draft(ids, feats.float(), None, 2, head.new_cache(64)) is None  # fp32 features
    long_ids = torch.randint(0, 96, (1, cpu_layers.MAX_TOKENS + 1))
    assert head.fused_draft(long_ids, torch.randn(1, long_ids.shape[1], 3, 128).bfloat16(), None, 2, head.new_cache(64)) is None
    with pytest.raises(ValueError, match="exceed the cache"):
        w = head._draft_weights(head._linears)
        cache = head.new_cache(4)
        cos, sin = head._rope.span(0, 5, feats)
        cpu_layers.eagle3_draft(head._layer_table(1, 3, None, cache), w, feats[0], ids[0], None, 3, cache.kv, 0,
                                cos, sin, heads=(4, 2), intermediate=256, eps=w["eps"], scale=0.17)


def test_bad_inputs_are_refused():
    target = _target()
    eng = target.engine
    w = dict(eng.layers[0])
    with pytest.raises(ValueError, match="contiguous CPU bf16"):
        cpu_layers.layer_table([{**w, "wo": w["wo"].float()}])
    cache = target.new_cache(capacity=8)
    cos, sin = eng.rope(torch.arange(8, 11).view(1, 3))
    x = torch.zeros(1, 3, 128, dtype=torch.bfloat16)
    kw = dict(heads=(eng.hq, eng.hkv), intermediate=256, eps=eng.eps, scale=eng.scale)
    with pytest.raises(ValueError, match="exceed the cache"):
        cpu_layers.run_layers(eng._layer_table(1, 3, None, cache.kv), x, cos, sin, cache.kv, 8, None, **kw)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_layers.run_layers(cpu_layers.layer_table([w]), x, cos, sin, cache.kv, 0, None, **kw)
    small = torch.empty(len(eng.layers), eng.hkv, 0, eng.head_dim, dtype=torch.bfloat16)  # no room for 3 columns
    with pytest.raises(ValueError, match="transposed keys"):
        cpu_layers.run_layers(eng._layer_table(1, 3, None, cache.kv), x, cos, sin, cache.kv, 0, None, **kw,
                              keys_t=(small, 0))
    assert not cpu_layers.supports(128, 256, 32, torch.float32, 1)
    assert not cpu_layers.supports(128, 256, 32, torch.bfloat16, cpu_layers.MAX_TOKENS + 1)
    # on the AMX products (where they run) up to MAX_TOKENS_AMX new tokens
    assert cpu_layers.supports(128, 256, 32, torch.bfloat16, cpu_layers.MAX_TOKENS_AMX, amx=True) == \
        cpu_layers.available(amx=True)
    assert not cpu_layers.supports(128, 256, 32, torch.bfloat16, cpu_layers.MAX_TOKENS_AMX + 1, amx=True)
    assert not cpu_layers.supports(100, 256, 32, torch.bfloat16, 1)


def test_rms_norm_is_hfs_norm():
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 64):
        x = (torch.randn(2, n, 192, generator=g) * 40).to(torch.bfloat16)  # activations of ~1e2
        w = (torch.rand(192, generator=g) + 0.5).to(torch.bfloat16)
        want = (w * F.rms_norm(x.float(), (192,), None, 1e-5).to(torch.bfloat16)).float()
        got = cpu_layers.rms_norm(x, w, 1e-5)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        diff = (got.float() - want).abs()
        # bf16 roundings in HF's places; the sum of squares in another order may move a last bit
        assert (diff <= want.abs() * 2 ** -7).all() and (diff > 0).float().mean() < 0.01
    assert cpu_layers.rms_norm(x.float(), w.float(), 1e-5) is None  # other dtypes: the caller's ops
    assert cpu_layers.rms_norm(x[..., :100], w[:100], 1e-5) is None  # H % 16
    assert cpu_layers.rms_norm(x, w.clone().requires_grad_(), 1e-5) is None  # autograd: the caller's ops
    with torch.no_grad():
        assert cpu_layers.rms_norm(x, w.clone().requires_grad_(), 1e-5) is not None


def test_silu_mul_is_torchs_silu_times_up():
    import torch.nn.functional as F

    from specfoundry.runtime.engine import silu_mul

    g = torch.Generator().manual_seed(0)
    for shape in ((1, 512), (3, 5, 64), (64, 768)):  # 64 rows of 384: the rows split over the threads
        gu = (torch.randn(*shape, generator=g) * 4).to(torch.bfloat16)
        gate, up = gu.chunk(2, dim=-1)
        want = (F.silu(gate) * up).float()
        got = cpu_layers.silu_mul(gu)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        diff = (got.float() - want).abs()
        # the same two bf16 roundings; the fp32 exp may differ from PyTorch's in a last bit, rarely visible
        assert (diff <= want.abs() * 2 ** -7).all() and (diff > 0).float().mean() < 0.01, shape
        assert torch.equal(silu_mul(gu), got)  # the engine's MLP takes it
    assert torch.equal(silu_mul(gu.float()), F.silu(gate.float()) * up.float())  # other dtypes: PyTorch's ops
    assert cpu_layers.silu_mul(gu.float()) is None
    assert cpu_layers.silu_mul(gu[..., :48]) is None  # I % 16
    assert cpu_layers.silu_mul(gu[:, :0]) is None
    assert cpu_layers.silu_mul(gu.clone().requires_grad_()) is None  # autograd: the caller's ops
    with torch.no_grad():
        assert cpu_layers.silu_mul(gu.clone().requires_grad_()) is not None


@pytest.mark.parametrize("n,past,hq,hkv,D", [(40, 0, 9, 3, 64), (203, 0, 9, 3, 32), (33, 50, 4, 4, 128), (2, 7, 6, 2, 64)])
def test_prefill_attention_from_the_fused_product_is_rope_then_the_causal_kernel(n, past, hq, hkv, D):
    # the engine's prefill in one call per layer (RoPE, K/V written, fp32 queries, attention, bf16 output)
    # gives the bits of the ops it replaces: rotate, the split, the cache copies and the causal kernel
    from specfoundry.runtime import cpu_attention
    from specfoundry.runtime.kvcache import rotate

    g = torch.Generator().manual_seed(n + past + D)
    layer = torch.randn(2, 1, hkv, past + n + 5, D, generator=g).bfloat16()
    qkv = (2 * torch.randn(1, n, hq + 2 * hkv, D, generator=g)).bfloat16()
    cos, sin = (torch.rand(2, n, D, generator=g) * 2 - 1).bfloat16()
    ref_layer = layer.clone()
    q, k = rotate(qkv[:, :, : hq + hkv], cos[None, :, None], sin[None, :, None]).split((hq, hkv), dim=2)
    want = cpu_attention.prefill_attention(ref_layer, q, k, qkv[:, :, hq + hkv:], past, D ** -0.5)
    got = cpu_layers.prefill_attention(layer, qkv, cos, sin, past, D ** -0.5)
    assert got.shape == want.shape == (1, n, hq * D) and got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(layer, ref_layer)


def test_argmax_is_torchs_argmax():
    from specfoundry.runtime.sampling import argmax

    g = torch.Generator().manual_seed(0)
    for V in (1, 15, 16, 49152, 1000):
        x = (torch.randn(5, V, generator=g) * 4).to(torch.bfloat16)  # bf16: many exact ties
        x[1] = x[1].round()  # ties everywhere: the first index wins
        x[2, : V // 2] = float("-inf")
        x[3] = float("-inf")
        if V > 3:
            x[4, V // 3] = float("nan")  # torch: a NaN counts as the maximum
            x[4, V - 1] = float("nan")
        want = x.float().argmax(-1)
        assert torch.equal(cpu_layers.argmax(x), want), V
        assert torch.equal(argmax(x.view(1, 5, V)), want.view(1, 5))  # the verifier's argmax takes it
    assert cpu_layers.argmax(x.float()) is None


def test_eagle3_feature_fusion_in_one_norm_call_equals_the_per_layer_norms():
    target = _target()
    head = load_drafter("eagle3", target=target).head
    with torch.no_grad():
        for i, norm in enumerate(head.feature_norms):  # distinct weights: a mixed-up layer would show
            norm.weight.copy_(torch.linspace(0.5, 1.5, 128).roll(40 * i))
    feats = (torch.randn(1, 7, len(head.feature_layers), 128, generator=torch.Generator().manual_seed(0)) * 50)
    feats = feats.to(torch.bfloat16)
    with torch.inference_mode():
        fused = head.fuse_features(feats)
        per_layer = head._lin(head.fc, torch.cat([head._norm(n, feats[:, :, i]) for i, n in enumerate(head.feature_norms)], -1))
    assert torch.equal(fused, per_layer)


@pytest.mark.parametrize("layer_kernel_faster", [True, False])
def test_the_kernel_choice_weighs_whole_forwards_with_the_layer_kernel(monkeypatch, layer_kernel_faster):
    # the products measured alone picked oneDNN; the layer kernel's whole forwards are then timed
    # against the op-by-op forward on that choice, and the faster stays
    target = _target()
    monkeypatch.setattr(LlamaEngine, "_choose_kernels", lambda self: ("onednn", "onednn"))
    monkeypatch.setattr(LlamaEngine, "_amx_usable", lambda self: False)  # (the AMX option: below)
    timed = []

    def fake(self, a, b):
        timed.append((a, b))
        return (1.0, 2.0) if layer_kernel_faster else (2.0, 1.0)

    monkeypatch.setattr(LlamaEngine, "_forward_seconds", fake)
    eng = LlamaEngine(target.model)
    assert timed == [(("avx512bf16", "avx512bf16", "onednn"), ("onednn", "onednn"))]
    assert eng.kernels == (("avx512bf16", "avx512bf16", "onednn") if layer_kernel_faster else ("onednn", "onednn"))
    # either way every weight the chosen kernels need is prepared, and a step runs
    cache = eng.new_cache(capacity=16)
    with torch.inference_mode():
        out = eng.forward(torch.tensor([[1, 2, 3]]), cache, torch.arange(3).view(1, 3))
    assert out.logits.shape == (1, 3, 96)


def test_forward_seconds_times_both_choices():
    target = _target()
    eng = target.engine
    was = eng.kernels
    ours, aten = ("avx512bf16", "avx512bf16", "onednn"), ("aten", "aten")
    eng._prepare(ours)
    eng._prepare(aten)
    with torch.inference_mode():
        a, b = eng._forward_seconds(ours, aten)
    assert 0 < a < 10 and 0 < b < 10 and eng.kernels == was


@pytest.mark.parametrize("drafter", [None, "eagle3"])
def test_a_server_with_one_client_steps_on_the_layer_kernel(monkeypatch, drafter):
    # one active row and no prefill chunk: the serving step takes the single-sequence kernel; each
    # request's greedy output is the solo generator's (plain) token for token, speculation forced on
    from specfoundry.runtime import SpeculativeGenerator
    from specfoundry.runtime.serving import Request, ServingEngine
    from specfoundry.runtime.serving import slots as slots_mod

    target = _target()
    rows = []
    real = slots_mod._one_row
    monkeypatch.setattr(slots_mod, "_one_row", lambda *a: (lambda out: rows.append(out is not None) or out)(real(*a)))
    g = torch.Generator().manual_seed(4)
    ps = [(torch.randint(0, 96, (6,), generator=g).tolist() * 3)[: 10 + 3 * i] for i in range(3)]
    solo = SpeculativeGenerator(target, None)
    want = [solo.generate(prompt_ids=p, max_new_tokens=20, stop_at_eos=False).token_ids for p in ps]
    d = None if drafter is None else load_drafter(drafter, target=target, tree="chain", depth=3)
    with ServingEngine(target, d, max_batch=4, speculation_table="1-:3" if d else None) as eng:
        got = [eng.submit(Request(p, max_new_tokens=20, stop_at_eos=False)).result()[0] for p in ps]  # one at a time
    assert got == want
    assert rows and all(rows)  # every decode step of a lone row took the kernel


def test_a_lone_serving_rows_transposed_keys_follow_its_slot(monkeypatch):
    """A server's lone row steps on the layer kernel with K transposed (as the generator's cache does);
    that copy follows row 0 through batched steps it is not written by, another sequence moving into
    row 0, a tree whose kept entries move, and a new sequence after the last one left: each lone step
    gives the logits of the same step on a fresh cache holding row 0's committed entries."""
    from specfoundry.runtime.serving import slots as slots_mod

    target = _target()
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(7)
    slots = slots_mod.SlotCache(target._engine(), slots=2, capacity=64)

    def add(n):
        c = target.new_cache()
        target.forward(torch.randint(0, 96, (1, n), generator=g), c)
        c.commit()
        slots.add(c)

    def step(n=1, tree=None, keep=None):
        B, lens = slots.active, slots.lengths[:slots.active]
        toks = torch.randint(0, 96, (B, n), generator=g)
        depths = torch.arange(n) if tree is None else tree_depths(tree)[0]
        pos = torch.tensor(lens).view(B, 1) + depths.view(1, n)
        block = None if tree is None else ancestor_matrix(tree).expand(B, n, n)
        was = len(calls)
        out = slots_mod.forward_slots(slots, toks, pos, block)
        if B == 1:  # the lone row: one kernel call, over the transposed keys
            assert len(calls) == was + 1
            past = lens[0]
            ref = target.new_cache(capacity=64)
            with torch.inference_mode():
                ref.kv[..., :past, :] = slots.kv[:, :, :1, :, :past]
            ref.length = past
            want = target.forward(toks, ref, position_ids=None if tree is None else pos,
                                  tree_mask=None if tree is None else ancestor_matrix(tree))
            assert torch.equal(out.logits, want.logits)
            kt, held = slots.transposed_keys()
            assert held == past and torch.equal(_row_major(kt)[:, :, :past], slots.kv[:, 0, 0, :, :past])
        slots.commit([torch.arange(n) if keep is None else torch.tensor(keep)] * B)

    add(12)
    step()
    step()  # row 0's transposed keys hold its committed columns
    add(20)
    step(2)  # a batched step: row 0's K grows without its transposed copy
    assert slots.remove(0) == 1  # the 20-token sequence moves into row 0
    step()
    step(5, tree=torch.tensor([[-1, 0, 0, 2, 2]]), keep=[0, 2, 4])  # kept entries 2 and 4 move
    step()
    add(9)
    step(3)
    assert slots.remove(1) is None  # the last row leaves: row 0 unchanged
    step()
    slots.remove(0)
    add(15)  # a new sequence in row 0 after none was left
    step()
    step(3)


def test_on_the_avx512_attention_every_serving_step_attends_by_the_kernel():
    # bf16 slots with D % 32 == 0: steps where every row drafts (3 tokens each) take the kernel too
    # (it beat SDPA by row ranges 1.26-1.48x there), equal to SDPA's within bf16 rounding
    from specfoundry.runtime.serving import slots as slots_mod

    target = _target()
    gen = torch.Generator().manual_seed(2)
    lens = [9, 30, 17, 6]
    slots = slots_mod.SlotCache(target._engine(), slots=4, capacity=64)
    for n in lens:
        cache = target.new_cache()
        target.forward(torch.randint(0, 96, (1, n), generator=gen), cache)
        cache.commit()
        slots.add(cache)
    assert slots.kernel and slots.rows_kernel and slots_mod.uses_kernel(slots, 4, 4 * 3)
    tokens = torch.randint(0, 96, (4, 3), generator=gen)
    pos = torch.tensor(lens).view(4, 1) + torch.arange(3)
    out_kernel = slots_mod.forward_slots(slots, tokens, pos)
    slots.kernel = False
    out_sdpa = slots_mod.forward_slots(slots, tokens, pos)
    a, b = out_kernel.logits.float(), out_sdpa.logits.float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max() and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("kernels, V, STEPS, scale, weights", [(FEW_ROW, 5, 3, 1.0, "int8"), (FEW_ROW, 5, 3, 0.6, "bf16"),
                                                               pytest.param(AMX, 32, 2, 1.0, "int8", marks=needs_amx)],
                         ids=["avx512bf16 int8 head", "avx512bf16 bf16 head draft temperature 0.6", "amx int8 head"])  # AMX: vocabularies of multiples of 32
def test_speculative_sampling_through_the_kernel_keeps_the_target_distribution(monkeypatch, kernels, V, STEPS, scale,
                                                                                 weights):
    # T=1 with an EAGLE-3 chain, every target step and head step on the layer kernel, the chain sampled
    # in the head's C call (at ``scale`` x T: runtime/calibrate.py; with the head's int8 or bf16 drafting
    # weights) and verified in C (cpu_verify): the distribution
    # of the first STEPS tokens is the target's own (exact, from the engine's forward), by chi-square;
    # the same harness rejects the head's own distribution
    from test_sampling_lossless import PROMPT, goodness_of_fit

    from specfoundry.runtime import SpeculativeGenerator, probs_from_logits
    from specfoundry.runtime.sampling import SamplingParams

    target = tiny_llama(5, vocab=V, hidden=128, layers=2, dtype=torch.bfloat16, init_std=0.3)
    target.engine = LlamaEngine(target.model, kernels=kernels)
    calls = _spy(monkeypatch)
    params = SamplingParams(1.0)
    exact = {}
    import itertools

    for seq in itertools.product(range(V), repeat=STEPS):
        cache = target.new_cache(capacity=16)
        logits = target.forward(torch.tensor([PROMPT + list(seq)]), cache).logits[0, len(PROMPT) - 1: -1]
        p = probs_from_logits(logits, params)
        exact[seq] = float(torch.prod(p[torch.arange(STEPS), torch.tensor(seq)]))
    drafter = load_drafter("eagle3", target=target, tree="chain", depth=2, draft_temperature=scale, head_weights=weights)
    assert drafter.head._linears.int8 == (weights == "int8")
    gen = SpeculativeGenerator(target, drafter, adaptive=False)
    # the drafts sampled in the head's one C call and verified by the C rejection sampler
    from specfoundry.runtime import cpu_verify
    from specfoundry.runtime.speculators.eagle import Eagle3Head

    ran = {"draft": 0, "verify": 0}
    real_draft, real_verify = Eagle3Head.fused_draft, cpu_verify.sampling_chain

    def draft_spy(self, *a):
        out = real_draft(self, *a)
        ran["draft"] += out is not None and out[2] is not None
        return out

    def verify_spy(*a):
        out = real_verify(*a)
        ran["verify"] += out is not None
        return out

    monkeypatch.setattr(Eagle3Head, "fused_draft", draft_spy)
    monkeypatch.setattr(cpu_verify, "sampling_chain", verify_spy)
    n, counts = 1500, {}
    for i in range(n):
        out = gen.generate(prompt_ids=PROMPT, max_new_tokens=STEPS, temperature=1.0, seed=7000 + i, stop_at_eos=False)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert calls and max(calls) > 1  # verifications of chains ran on the kernel
    assert ran["draft"] > n // 2 and ran["verify"] > n  # sampled C drafts, C verifications
    p_value, _ = goodness_of_fit(exact, counts, n)
    assert p_value > 1e-3
    # the check can fail: a distribution that is not the target's (its tokens shifted by one) is rejected
    shifted = {tuple((t + 1) % V for t in k): v for k, v in exact.items()}
    assert goodness_of_fit(shifted, {k: c for k, c in counts.items() if shifted.get(k, 0) > 0}, n)[0] < 1e-3


def test_tree_ranking_helpers():
    """The C log-probabilities are PyTorch's within fp32 rounding; topk_first returns torch.topk's values
    with equal values in index order, ties across the cut included."""
    from specfoundry.runtime.drafters.eagle import topk_first

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 4099, generator=g) * 4).bfloat16()  # not a multiple of 16: the masked tail
    got = cpu_layers.log_softmax(x)
    assert (got - torch.log_softmax(x.float(), -1)).abs().max() < 2e-5
    assert cpu_layers.log_softmax(x.float()) is None
    v = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0], [5.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    vals, idx = topk_first(v, 2)
    assert idx.tolist() == [[1, 2], [0, 1]] and vals.tolist() == [[3.0, 3.0], [5.0, 1.0]]
    vals, idx = topk_first(v, 4)
    assert idx.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]]
    r = torch.randn(3, 50, generator=g)
    assert torch.equal(topk_first(r, 7)[0], r.topk(7).values)


def test_fused_drafting_grows_a_full_head_cache(monkeypatch):
    """A head cache that fills up mid-generation is grown before the C call writes into it: the drafts
    and outputs still equal the step-by-step path's."""
    from specfoundry.runtime.speculators.eagle import Eagle3Head

    real_new = Eagle3Head.new_cache
    monkeypatch.setattr(Eagle3Head, "new_cache", lambda self, capacity=1024: real_new(self, 20))
    target = _target(init_std=0.5)
    drafter = _eagle3_chain(target, tree="dynamic", top_k=4, total_tokens=10, depth=3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (6,), generator=g).tolist() * 3 for _ in range(2)]
    fused = _drafts_and_outputs(target, drafter, prompts)
    assert drafter.cache.capacity > 20  # it grew
    monkeypatch.setattr(Eagle3Head, "fused_draft", lambda *a, **k: None)
    step_by_step = _drafts_and_outputs(target, drafter, prompts)
    assert fused[1] == step_by_step[1]
    assert [(t, p) for t, p, *_ in fused[0]] == [(t, p) for t, p, *_ in step_by_step[0]]


def test_the_heads_prepared_weights_follow_edits_and_replacements():
    """The drafting head's layer table and fused-draft weights are kept between steps (a cheap
    check of the tensors' identity, storage and version counters) and remade when a weight is
    edited in place or replaced by another tensor."""
    head = _eagle3_chain(_target()).head
    cache = head.new_cache(64)
    run = head._linears

    def prepared():
        return head._layer_table(1, 2, None, cache), head._draft_weights(run)

    t0, w0 = prepared()
    assert t0 is not None and w0 is not None
    t1, w1 = prepared()
    assert t1 is t0 and w1["fnw"] is w0["fnw"]  # unchanged weights: the same prepared objects
    with torch.no_grad():
        head.layer.mlp.down_proj.weight.mul_(1.5)  # an in-place edit
    t2, _ = prepared()
    assert t2 is not t0
    head.layer.self_attn.q_proj.weight = torch.nn.Parameter(head.layer.self_attn.q_proj.weight.detach().clone())
    t3, _ = prepared()
    assert t3 is not t2
    with torch.no_grad():
        head.norm.weight.add_(0.25)  # the output norm: a fused-draft weight
    _, w4 = prepared()
    assert w4["fnw"] is not w0["fnw"] and torch.equal(w4["onw"], head.norm.weight)
    head.feature_norms[0].weight = torch.nn.Parameter(head.feature_norms[0].weight.detach() * 2)
    _, w5 = prepared()
    assert w5["fnw"] is not w4["fnw"] and torch.equal(w5["fnw"][0], head.feature_norms[0].weight)


def test_the_draft_plan_is_taken_once_per_request_and_follows_edits():
    """``Eagle3Head.draft_plan``: the same plan while nothing it reads changed, a new one after an
    in-place edit or a replaced weight (here the fc and the LM head, which only it checks for the
    fused drafting); the drafter takes it at its first drafting step of a request and keeps it until
    the next ``begin``, whose drafts then follow the edit (equal to the step-by-step path's)."""
    target = _target()
    drafter = _eagle3_chain(target, depth=2)
    head = drafter.head
    cache = head.new_cache(64)
    p0 = head.draft_plan(cache)
    assert p0 is not None and head.draft_plan(cache) is p0
    with torch.no_grad():
        head.fc.weight.mul_(1.25)
    p1 = head.draft_plan(cache)
    assert p1 is not p0 and p1[1]["fcw"] is not p0[1]["fcw"]
    head.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.detach() * 1.5)
    p2 = head.draft_plan(cache)
    assert p2 is not p1 and head.draft_plan(cache) is p2

    prompt, feats = torch.tensor([[1, 2, 3, 4, 5]]), torch.randn(1, 4, 3, 128).bfloat16()
    ctx = DraftContext(prompt, SamplingParams(0.0), 2, 3)
    drafter.begin(prompt, feats)
    assert drafter._plan is False  # not taken before the first drafting step
    drafter.propose(ctx)
    taken = drafter._plan
    assert taken is p2
    with torch.no_grad():
        head.lm_head.weight.mul_(-1.0)  # during the request: not seen until the next one
    drafter.commit(torch.tensor([[7]]), torch.randn(1, 1, 3, 128).bfloat16())
    drafter.propose(DraftContext(torch.cat([prompt, torch.tensor([[7]])], 1), SamplingParams(0.0), 2, 3))
    assert drafter._plan is taken
    drafter.begin(prompt, feats)
    fused = drafter.propose(ctx)
    assert drafter._plan is not taken
    drafter.begin(prompt, feats)
    drafter._plan = None  # the step-by-step path, with the edited weights
    step_by_step = drafter.propose(ctx)
    assert fused.tokens.tolist() == step_by_step.tokens.tolist()
    assert fused.parents.tolist() == step_by_step.parents.tolist()


@pytest.mark.parametrize("name", ["avx512bf16", pytest.param("amx", marks=needs_amx)])
def test_the_environment_names_the_layer_kernels_products(monkeypatch, name):
    # SPECFOUNDRY_KERNELS replaces the engine's timed choice (a deployment that always speculates may
    # want AMX's cheaper verifications where plain steps prefer AVX-512 BF16); other names are refused
    target = _target()
    monkeypatch.setattr(LlamaEngine, "_forward_seconds", lambda self, a, b: pytest.fail("timed although named"))
    monkeypatch.setenv(KERNELS_ENV, name)
    eng = LlamaEngine(target.model)
    assert eng.kernels[:2] == (name, name)
    # only the named products' copies (and the many-row kernel's) are kept
    assert {k.split("@")[1] for w in eng.layers + [eng.head] for k in w if "@" in k} <= set(eng.kernels)
    cache = eng.new_cache(capacity=8)
    with torch.inference_mode():
        assert eng.forward(torch.tensor([[1, 2]]), cache).logits.shape == (1, 2, 96)
    monkeypatch.setenv(KERNELS_ENV, "avx2")
    with pytest.raises(ValueError, match=f"{KERNELS_ENV}='avx2'.*avx512bf16"):
        LlamaEngine(target.model)


# -- the layer kernel's products on the AMX tiles (cpu_gemv.gemv_amx); CPUs with AMX only ------------------
@needs_amx
def test_greedy_speculation_equals_plain_on_the_amx_layer_kernel(monkeypatch):
    target = _target(kernels=AMX)
    calls = _spy(monkeypatch)
    assert_greedy_speculation_is_plain(target, [("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3}),
                                                ("eagle3", {"depth": 3, "total_tokens": 8}),
                                                ("eagle3", {"depth": 4, "total_tokens": 24})], vocab=96)
    assert 1 in calls and max(calls) > cpu_layers.MAX_TOKENS  # (trees of up to 24 nodes in one C call)
    # the heads' own few-row products stay on the AVX-512 BF16 kernel (their weights are read from the
    # caches); a pass over a prompt's pairs takes the tiles
    head = load_drafter("eagle3", target=target).head
    assert head.__dict__["_linears"].kernels == ("avx512bf16", "avx512bf16", "amx")


@needs_amx
def test_a_heads_many_row_products_take_the_tiles_where_its_sizes_allow():
    # a head's pass over a prompt (more than 8 rows) on the AMX tiles, its few-row steps on AVX-512 BF16;
    # a weight whose sizes the tiles do not take stays on AVX-512 BF16 for any row count
    from specfoundry.runtime.engine import PreparedLinears

    run = PreparedLinears(AMX)
    g = torch.Generator().manual_seed(0)
    ok, odd = torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(64, 40, bias=False)
    for lin in (ok, odd):
        lin.weight.data = torch.randn(lin.weight.shape, generator=g).bfloat16()
    for lin, many in ((ok, "amx"), (odd, "avx512bf16")):
        run.prepare((lin,))
        for rows, kernel in ((1, "avx512bf16"), (5, "avx512bf16"), (40, many)):
            x = torch.randn(rows, 64, generator=g).bfloat16()
            y = run(lin, x)
            assert run._takes((lin,), kernel_for(run.kernels, rows)) == kernel
            ref = x.float() @ lin.weight.float().t()
            assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert {k for _, k in run._prepared} == {"avx512bf16", "amx"}


@needs_amx
@pytest.mark.parametrize("nodes", [7, 24])  # 24: past MAX_TOKENS (AVX-512 BF16's limit), one C call on AMX
@pytest.mark.parametrize("head_dim", [64, 128])  # 2 and 4 tile products per block of scores
def test_amx_layer_kernel_gives_each_tree_node_its_plain_steps_bits(head_dim, nodes):
    # the AMX build scores the attention on the tiles: a node's logits in a verification must be the
    # bits of plain steps along its path (its ancestors then itself), and close to the op-by-op forward;
    # scores summed in another order for plain steps than for verifications fail here, and so does a
    # tree larger than MAX_TOKENS handed to the many-row products and PyTorch's ops
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=128 // head_dim, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # K channels over 20 binades: the scores' fp32 sums round, so their order shows
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            w.mul_(torch.logspace(-10, 10, w.shape[0], base=2)[torch.randperm(w.shape[0])].view(-1, 1).to(w.dtype))
    target = wrap_target(model, name=f"tiny-d{head_dim}", backend="engine")
    target.engine = LlamaEngine(target.model, kernels=AMX)
    g = torch.Generator().manual_seed(3)
    prefix, toks = torch.randint(0, 96, (1, 37), generator=g), torch.randint(0, 96, (1, nodes), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 4] if nodes == 7 else \
        [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes)]
    P = torch.tensor([parents])

    def verify(layer_kernel):
        target.engine.use_layer_kernel = layer_kernel
        cache = target.new_cache(capacity=64)
        target.forward(prefix, cache)
        cache.commit()
        return target.forward(toks, cache, position_ids=37 + tree_depths(P), tree_mask=ancestor_matrix(P)).logits[0]

    ref = verify(False).float()
    logits = verify(True)  # (the layer kernel stays on for the plain steps below)
    # (bf16 roundings in another order, amplified by K's 20 binades: 24 nodes measured 2.1% at most, 0.45% on average)
    err = (logits.float() - ref).abs()
    assert err.max() <= 0.03 * ref.abs().max() and err.mean() <= 0.01 * ref.abs().mean()
    for node in range(nodes):
        path, i = [], node
        while i >= 0:
            path.insert(0, i)
            i = parents[i]
        cache = target.new_cache(capacity=64)
        target.forward(prefix, cache)
        cache.commit()
        for i in path:
            step = target.forward(toks[:, i:i + 1], cache).logits[0, 0]
            cache.commit()
        assert torch.equal(step, logits[node]), f"node {node}"


@needs_amx
@pytest.mark.parametrize("winner", ["avx512bf16", "amx"])
def test_the_kernel_choice_times_the_amx_layer_kernel_and_never_mixes(monkeypatch, winner):
    # the products alone chose AVX-512 BF16 for one row and AMX for several: that mix is not offered
    # (a verified token's logits would differ from a plain step's in the last bits); the two layer
    # kernels are timed against each other and the loser's prepared weights are dropped
    target = _target()
    monkeypatch.setattr(LlamaEngine, "_choose_kernels", lambda self: ("avx512bf16", "amx", "onednn"))
    timed = []

    def fake(self, a, b):
        timed.append((a, b))
        return (1.0, 2.0) if a[0] == winner else (2.0, 1.0)

    monkeypatch.setattr(LlamaEngine, "_forward_seconds", fake)
    eng = LlamaEngine(target.model)
    assert timed == [(("avx512bf16", "avx512bf16", "onednn"), ("amx", "amx", "onednn"))]
    assert eng.kernels == (winner, winner, "onednn")
    loser = "amx" if winner == "avx512bf16" else "avx512bf16"
    keys = {k for w in eng.layers + [eng.head] for k in w}
    assert not any(k.endswith("@" + loser) for k in keys) and any(k.endswith("@" + winner) for k in keys)
    cache = eng.new_cache(capacity=16)
    with torch.inference_mode():
        out = eng.forward(torch.tensor([[1, 2, 3]]), cache, torch.arange(3).view(1, 3))
        cache.commit()
        one = eng.forward(torch.tensor([[4]]), cache)
    assert out.logits.shape == (1, 3, 96) and one.logits.shape == (1, 1, 96)


@needs_amx
@pytest.mark.parametrize("measured", [("avx512bf16", "amx"), ("amx", "onednn")])
def test_the_products_alone_never_choose_amx_for_one_row_count_only(monkeypatch, measured):
    # the products' timings say (one-row winner, several-row winner); AMX for only one of them is not
    # returned: it takes both row counts or neither
    from specfoundry.runtime import engine as engine_mod

    one, several = measured
    eng = _target().engine
    last = {}
    kernels = dict(engine_mod.KERNELS)

    def timed_apply(name):
        def apply(x, p, b=None):
            last["cost"] = 1.0 if name == (one if x.shape[0] == 1 else several) else 2.0
            return kernels[name][1](x, p, b)
        return apply

    monkeypatch.setattr(engine_mod, "KERNELS", {k: (v[0], timed_apply(k)) for k, v in kernels.items()})
    monkeypatch.setattr(engine_mod, "best_seconds", lambda fn, *a, **k: fn() and last.pop("cost"))
    chosen = eng._choose_kernels()
    assert "amx" in chosen[:2] and chosen[0] == chosen[1] == "amx" if several == "amx" else "amx" not in chosen[:2]
