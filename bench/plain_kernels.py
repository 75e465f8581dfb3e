"""The products our plain decoding runs fastest on, measured before a benchmark, so speed-ups count
against the fastest plain decoding the project has (issue 11).

The engine chooses one product set for plain steps and verifications alike (a 1-token plus a
4-token forward, ``LlamaEngine._prefer_layer_kernel``), since AMX's sums differ from AVX-512 BF16's
in the last bits and mixing them would let a verified token differ from a plain step's. On a CPU
with AMX that choice can favour the verifications while plain decoding alone is faster on AVX-512
BF16 (thirty-third session: AMX plain decoding 0.85-0.94x AVX-512's on the same Xeon where it had
been 1.01x a day earlier). So the bench times plain decoding on every product set the layer kernel
can use here, in alternation, and runs its ``plain`` (the reference of every speed-up) on the
fastest; where that is not the engine's own choice, ``plain@<kernel>`` runs plain decoding on the
engine's products as well, and the speculative methods' greedy outputs are checked against it
(the same arithmetic: token for token, no near-tie judgement needed).
"""

from __future__ import annotations

import statistics

from specfoundry.runtime.generator import SpeculativeGenerator


def plain_kernel_choice(target, prompt_ids: list[int], *, tokens: int = 48, rounds: int = 3) -> dict:
    """``{"engine": the engine's kernels, "plain": the fastest for plain decoding, "ms_per_token":
    {kernel: median decode ms per token}}`` (kernels as the engine's tuples; ``ms_per_token`` empty
    where there is nothing to choose: another backend, or one product set). Each set decodes
    ``tokens`` greedy tokens of ``prompt_ids`` per round, the order alternating; a first round warms
    them up (their prepared weights stay for the run)."""
    engine = target._engine() if hasattr(target, "_engine") else None
    if engine is None:
        return {"engine": None, "plain": None, "ms_per_token": {}}
    options = engine.layer_kernel_options()
    if len(options) < 2:
        return {"engine": engine.kernels, "plain": engine.kernels, "ms_per_token": {}}
    gen = SpeculativeGenerator(target)
    per_token: dict[tuple, list[float]] = {o: [] for o in options}
    for r in range(rounds + 1):
        for o in options if r % 2 else options[::-1]:
            with engine.using_kernels(o):
                out = gen.generate(prompt_ids=prompt_ids, max_new_tokens=tokens, temperature=0.0, speculate=False,
                                   stop_at_eos=False)
            s = out.stats
            if r:
                per_token[o].append((s.seconds - s.prefill_seconds) / max(s.new_tokens - 1, 1))
    ms = {o: 1000 * statistics.median(v) for o, v in per_token.items()}
    return {"engine": engine.kernels, "plain": min(options, key=ms.get), "ms_per_token": ms}


def kernels_name(kernels) -> str:
    """``("amx", "amx", "onednn")`` -> ``"amx/amx/onednn"`` (report text and JSON keys)."""
    return "/".join(kernels) if kernels else "-"


def apply_plain_kernels(methods: list, target, choice: dict) -> list:
    """``methods`` with ``plain`` (first) run on ``choice["plain"]``; where that is not the engine's
    own choice, ``plain@<kernel>`` (plain decoding on the engine's products) after it, and every
    speculative method's greedy output checked against that one."""
    from .methods import Method, generator_runner

    if choice["plain"] == choice["engine"]:
        return methods
    plain, rest = methods[0], methods[1:]
    inner = plain.runner

    def fastest(*args):
        with target._engine().using_kernels(choice["plain"]):
            return inner(*args)

    plain.runner = fastest
    plain.note = (f"on the {kernels_name(choice['plain'])} products, the fastest plain decoding measured here "
                  f"(the engine's choice {kernels_name(choice['engine'])} is `plain@{choice['engine'][0]}`)")
    same = Method(f"plain@{choice['engine'][0]}", "our plain decoding on the engine's own products (the "
                  "speculative methods' greedy reference: the same arithmetic)", "ours",
                  generator_runner(SpeculativeGenerator(target), speculate=False), draft_depth=0, check="info")
    for m in rest:
        if m.kind == "ours" and m.draft_depth:
            m.reference = same.name
    return [plain, same] + rest
