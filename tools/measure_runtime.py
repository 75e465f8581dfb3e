"""Measure the runtime on the default target: plain tok/s and, per drafter, tau,
identical-output rate and wall-clock ratio vs plain decoding (methods interleaved per prompt
after a warm-up, so a noisy shared machine affects both alike). Prints a markdown table.

    .venv/bin/python tools/measure_runtime.py --prompts 12 --max-new-tokens 128 [--drafter ngram]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys

import torch
from tqdm import tqdm

from specfoundry.runtime import SpeculativeGenerator, load_drafter, load_target
from specfoundry.runtime.lossless import compare_greedy

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, then show two example calls.",
    "Explain what a hash table is and how collisions are handled.",
    "Rewrite this sentence in a formal tone: 'hey, the meeting got moved to friday, don't be late'.",
    "List the steps to make a cup of tea, numbered.",
    "Write a JavaScript function that debounces another function, with comments.",
    "Summarize the water cycle in four sentences.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Give three tips for writing a good commit message, and an example of one.",
    "Translate into Spanish: 'The library opens at nine and closes at six on weekdays.'",
    "Write a Python class for a stack with push, pop and peek methods, and a short usage example.",
    "What is the difference between a list and a tuple in Python? Give examples.",
    "Write a short story of five sentences about a robot learning to paint.",
    "Explain recursion to a beginner using the factorial function as an example in Python.",
    "Convert this JSON to YAML: {\"name\": \"demo\", \"version\": 2, \"tags\": [\"a\", \"b\"]}",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", default=None, help="repeatable; default: ngram")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--json", default=None, help="also write the raw figures to this file")
    args = ap.parse_args()
    drafters = args.drafter or ["ngram"]
    prompts = PROMPTS[: args.prompts]

    target = load_target(args.target)
    gens = {name: SpeculativeGenerator(target, load_drafter(name, target=target), adaptive=not args.no_adaptive)
            for name in drafters}
    plain_gen = SpeculativeGenerator(target)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_at_eos=False)
    # warm-up (allocator, first-call overheads) outside the measurement
    plain_gen.generate(prompt=prompts[0], max_new_tokens=8, speculate=False)
    for g in gens.values():
        g.generate(prompt=prompts[0], max_new_tokens=8)

    rows = {name: [] for name in drafters}
    plain_runs = []
    for prompt in tqdm(prompts, desc="prompts", file=sys.stderr):
        plain = plain_gen.generate(prompt=prompt, speculate=False, **kw)
        plain_runs.append(plain.stats)
        for name, g in gens.items():  # interleaved: plain, A, B, ... per prompt
            spec = g.generate(prompt=prompt, **kw)
            cmp = compare_greedy(target, spec.prompt_ids, spec.token_ids, plain.token_ids)
            rows[name].append({"tau": spec.stats.tau, "identical": cmp.identical, "near_tie": cmp.near_tie,
                               "ratio": plain.stats.seconds / spec.stats.seconds,
                               "tok_s": spec.stats.tokens_per_second})

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    plain_tok_s = statistics.median(s.tokens_per_second for s in plain_runs)
    print(f"\nTarget {args.target} (fp32, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}), commit {commit}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, greedy, adaptive={'off' if args.no_adaptive else 'on'}\n")
    print("| method | tau (mean) | identical | near-ties | tok/s (median) | wall-clock speed-up vs plain (median) |")
    print("|---|---|---|---|---|---|")
    print(f"| plain | 1.00 | - | - | {plain_tok_s:.1f} | 1.00x |")
    out = {"plain_tok_s": plain_tok_s, "drafters": {}}
    for name, r in rows.items():
        tau = statistics.mean(x["tau"] for x in r)
        ident = sum(x["identical"] for x in r)
        ties = sum(x["near_tie"] for x in r)
        ratio = statistics.median(x["ratio"] for x in r)
        tok_s = statistics.median(x["tok_s"] for x in r)
        print(f"| {name} | {tau:.2f} | {ident}/{len(r)} | {ties} | {tok_s:.1f} | {ratio:.2f}x |")
        out["drafters"][name] = {"tau": tau, "identical": ident, "n": len(r), "near_ties": ties, "ratio": ratio, "runs": r}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    bad = [n for n, r in rows.items() if any(not (x["identical"] or x["near_tie"]) for x in r)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
