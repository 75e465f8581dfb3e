"""Greedy exactness on the real SmolLM2-135M (float32): speculative output equals plain greedy
output; a divergence is only accepted when it is a rounding near-tie, and it is reported."""

import pytest

from specfoundry.runtime import SpeculativeGenerator, available_drafters, load_drafter
from specfoundry.runtime.lossless import compare_greedy


SMOL_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and an example.",
    "Explain in a few sentences why the sky is blue.",
    "List five tips for writing clean code, one line each.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]


@pytest.mark.parametrize("drafter_name", ["ngram", "eagle3"])
def test_greedy_exact_on_smollm2(smollm2, drafter_name):
    if drafter_name not in available_drafters():
        pytest.fail(f"drafter {drafter_name} is not registered")
    drafter = load_drafter(drafter_name, target=smollm2)
    gen = SpeculativeGenerator(smollm2, drafter)
    report = []
    for prompt in SMOL_PROMPTS:
        spec = gen.generate(prompt=prompt, max_new_tokens=64, stop_at_eos=False)
        plain = gen.generate(prompt=prompt, max_new_tokens=64, stop_at_eos=False, speculate=False)
        assert len(spec.token_ids) == len(plain.token_ids) == 64
        cmp = compare_greedy(smollm2, spec.prompt_ids, spec.token_ids, plain.token_ids)
        if not cmp.identical:
            report.append(f"{prompt[:40]!r}: diverged at {cmp.first_divergence}, top-2 gap {cmp.top2_gap:.2e}")
        assert cmp.ok, f"non-near-tie divergence ({drafter_name}): {cmp}"
    if report:  # near-ties are allowed but shown
        print("near-tie divergences:\n" + "\n".join(report))
