"""Greedy exactness on the real SmolLM2-135M (float32): speculative output equals plain greedy
output; a divergence is only accepted when it is a rounding near-tie, and it is reported."""

import warnings

import pytest

from specfoundry.runtime import SpeculativeGenerator, available_drafters, load_drafter
from specfoundry.runtime.drafters.draft import DraftModelDrafter, layer_subset_model
from specfoundry.runtime.lossless import compare_greedy


SMOL_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and an example.",
    "Explain in a few sentences why the sky is blue.",
    "List five tips for writing clean code, one line each.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]


def test_every_drafter_type_is_checked_on_smollm2():
    assert set(DRAFTERS) == set(available_drafters())


DRAFTERS = ["ngram", "draft", "medusa", "eagle", "eagle3"]


@pytest.fixture(scope="module")
def plain_runs(smollm2):
    """The target's own greedy output per prompt, computed once for all drafters."""
    gen = SpeculativeGenerator(smollm2)
    return [gen.generate(prompt=p, max_new_tokens=64, stop_at_eos=False, speculate=False) for p in SMOL_PROMPTS]


@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_exact_on_smollm2(smollm2, plain_runs, drafter_name):
    if drafter_name == "draft":
        # a real draft LM sharing the tokenizer: 6 of the target's 30 layers (untrained as a draft)
        drafter = DraftModelDrafter(layer_subset_model(smollm2, [0, 1, 2, 3, 27, 29]), smollm2)
    else:
        drafter = load_drafter(drafter_name, target=smollm2)
    gen = SpeculativeGenerator(smollm2, drafter)
    report = []
    for prompt, plain in zip(SMOL_PROMPTS, plain_runs):
        spec = gen.generate(prompt=prompt, max_new_tokens=64, stop_at_eos=False)
        assert len(spec.token_ids) == len(plain.token_ids) == 64
        cmp = compare_greedy(smollm2, spec.prompt_ids, spec.token_ids, plain.token_ids)
        if not cmp.identical:
            report.append(f"{prompt[:40]!r}: diverged at {cmp.first_divergence}, top-2 gap {cmp.top2_gap:.2e}")
        assert cmp.ok, f"non-near-tie divergence ({drafter_name}): {cmp}"
    if report:  # near-ties are allowed but shown
        warnings.warn("near-tie divergences (rounding, allowed):\n" + "\n".join(report))
