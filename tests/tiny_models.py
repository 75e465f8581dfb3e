"""Tiny random Llama models for exact (float64) tests.

They run on the engine (:mod:`specfoundry.runtime.engine`) by default, as ``load_target`` does
for Llama-family models; ``backend="hf"`` gives the HF path, which tests also cover."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfoundry.runtime.models import wrap_target


def tiny_llama(seed: int = 0, vocab: int = 64, hidden: int = 32, layers: int = 4, dtype=torch.float64,
               init_std: float = 0.5, backend: str = "engine"):
    """A tiny random Llama. A large init std makes its distributions peaked, like a real LM's."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=init_std, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(dtype)
    return wrap_target(model, name=f"tiny-{seed}", backend=backend)


def perturbed_copy(t, scale: float, seed: int = 123):
    """A draft model that mostly agrees with ``t`` (partial acceptance)."""
    g = torch.Generator().manual_seed(seed)
    m = LlamaForCausalLM(t.model.config).to(t.dtype)
    m.load_state_dict(t.model.state_dict())
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp(min=1e-3))
    return wrap_target(m, name=f"{t.name}-perturbed", backend=getattr(t, "backend", "hf"))


def assert_greedy_speculation_is_plain(target, drafters, vocab: int, seed: int = 3, prompts: int = 3,
                                       near_ties: bool = False) -> None:
    """For each ``(source, options)`` in ``drafters``: greedy speculative output on repeated random
    prompts (repeats give the n-gram drafter matches) is the plain greedy output token for token;
    ``near_ties``: or it leaves it only where rounding explains the flip (the float32 check of
    :func:`~specfoundry.runtime.lossless.compare_greedy`, for trees on a bf16 target)."""
    from specfoundry.runtime import SpeculativeGenerator, load_drafter
    from specfoundry.runtime.lossless import compare_greedy

    g = torch.Generator().manual_seed(seed)
    for source, opts in drafters:
        gen = SpeculativeGenerator(target, load_drafter(source, target=target, **opts), adaptive=False)
        for _ in range(prompts):
            base = torch.randint(0, vocab, (6,), generator=g).tolist()
            kw = dict(prompt_ids=base * 3, max_new_tokens=24, stop_at_eos=False)
            spec, plain = gen.generate(**kw), gen.generate(speculate=False, **kw)
            if near_ties and spec.token_ids != plain.token_ids:
                verdict = compare_greedy(target, base * 3, plain.token_ids, spec.token_ids)
                assert verdict.ok, (source, opts, verdict)
            else:
                assert spec.token_ids == plain.token_ids, (source, opts)


TINY_PROMPTS = ["Write a haiku about rain.", "What is 2 + 2?", "Name three colors.", "Explain gravity briefly.",
                "Give me a synonym for happy.", "Translate 'cat' to French.", "List two prime numbers.",
                "What is the capital of Italy?", "Say hello politely.", "Describe a cat in one sentence.",
                "Count to five.", "Why is the sea salty?"]


def tiny_target_with_smollm2_tokenizer(d, vocab_size: int):
    """A tiny random Llama saved in ``d`` with SmolLM2's tokenizer (and vocabulary size), so recipes
    run their whole path (chat template, Magpie, generation) on it in seconds."""
    from transformers import AutoTokenizer

    from specfoundry.runtime.models import builtin_model_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(d)
    AutoTokenizer.from_pretrained(builtin_model_dir("smollm2-135m")).save_pretrained(d)
    return d


def record_host_reads(monkeypatch) -> list[str]:
    """From now on (until ``monkeypatch`` is undone), every read of a tensor's value on the host
    (item, tolist, nonzero, bool, int, index, float) appends its name to the returned list: what a
    CUDA graph cannot capture."""
    reads: list[str] = []

    def spy(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            reads.append(name)
            return real(self, *a, **k)
        return wrapper

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    return reads
