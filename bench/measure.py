"""The measurement loop: every method on every prompt, interleaved, after a warm-up.

Per prompt turn the chat template is applied once (``target.encode_chat``) and the same prompt
ids go to every method, our plain decoding first and the others after it in an order that
rotates from prompt to prompt (so no method always runs in the same slot). Multi-turn prompts
(MT-bench) put our plain decoding's answer to turn 1 into the history of turn 2 for every method.
Each record keeps the wall clock of the call and its ratio against plain decoding of the *same*
prompt (``speed_up`` per generated token, ``wall_ratio`` per call; equal when both produced the
same number of tokens, as at T=0). At T=0 each output is compared with the reference greedy
output by :func:`~specfoundry.runtime.lossless.compare_greedy`: ``identical``, ``near_tie``
(a rounding flip, reported separately), or ``FAIL`` (a lossless violation).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

from tqdm import tqdm

from specfoundry.runtime.logs import stderr_logger
from specfoundry.runtime.lossless import compare_greedy

from .methods import Method, RunResult
from .prompts import BenchPrompt

_STAT_KEYS = ("tau", "acceptance_by_position", "tried", "passed", "drafted", "accepted", "target_forwards", "prefill_seconds",
              "draft_seconds", "verify_seconds", "speculative_steps", "plain_steps")
_log = stderr_logger("bench")


def rss_mb() -> float | None:
    """This process's resident memory now, in MB (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def cpu_ticks(stat: str | None = None) -> tuple[int, int] | None:
    """(ticks stolen by the hypervisor, all ticks) summed over this machine's CPUs since boot, from
    ``/proc/stat`` (or its text ``stat``); None where there is none. Steal is time this VM's vCPUs
    were ready to run but the host ran something else: on the shared 2-core development machine it
    reached 50% for minutes at a time, halving every measured speed (docs/results.md, twentieth
    session), so a benchmark records it beside what it measured."""
    try:
        if stat is None:
            with open("/proc/stat") as f:
                stat = f.read()
        fields = [int(x) for x in stat.splitlines()[0].split()[1:]]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
        return fields[7], sum(fields[:8])
    except (OSError, ValueError, IndexError):
        return None


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the CPU time between two :func:`cpu_ticks` readings that was stolen."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def unit_seed(seed: int, repeat: int, prompt: BenchPrompt, turn: int) -> int:
    """The sampling seed of one prompt turn (the same for every method)."""
    return (seed + 7919 * repeat + zlib.crc32(f"{prompt.key}:{prompt.question_id}:{turn}".encode())) % (2**31)


def check_output(target, method: Method, prompt_ids, out: RunResult, ref: RunResult | None, temperature: float) -> dict:
    if method.kind == "plain" or temperature > 0 or method.check == "none":
        return {"status": "n/a"}
    if ref is None:
        return {"status": "n/a", "reason": f"no {method.reference} output to compare with"}
    cmp = compare_greedy(target, prompt_ids, out.token_ids, ref.token_ids)
    if cmp.identical:
        status = "identical"
    elif method.check == "exact":
        status = "differs"  # other weights (a GGUF): our target's logits cannot call it a near-tie
    elif cmp.near_tie:
        status = "near_tie"
    else:
        status = "FAIL" if method.check == "strict" else "differs"
    return {"status": status, "reference": method.reference, "first_divergence": cmp.first_divergence,
            "top2_gap": cmp.top2_gap}


def make_record(unit: dict, method: Method, out: RunResult, plain: RunResult, order: int, check: dict) -> dict:
    n, pn = len(out.token_ids), len(plain.token_ids)
    speed_up = (plain.seconds / pn) / (out.seconds / n) if n and pn and out.seconds > 0 else None
    # the same ratio with each call's prefill taken out, what a long answer approaches: at 64 new tokens the
    # prefill (the same work for every method) took 15% of plain decoding's time on the median Spec-Bench prompt
    pre, plain_pre = (out.stats or {}).get("prefill_seconds"), (plain.stats or {}).get("prefill_seconds")
    decode = None
    if n and pn and pre is not None and plain_pre is not None and out.seconds > pre and plain.seconds > plain_pre:
        decode = ((plain.seconds - plain_pre) / pn) / ((out.seconds - pre) / n)
    rec = {**{k: v for k, v in unit.items() if k != "prompt_ids"}, "method": method.name, "order": order,
           "new_tokens": n, "seconds": out.seconds, "tokens_per_second": n / out.seconds if out.seconds > 0 else 0.0,
           "plain_seconds": plain.seconds, "plain_new_tokens": pn, "plain_prefill_seconds": plain_pre,
           "wall_ratio": plain.seconds / out.seconds if out.seconds > 0 else None, "speed_up": speed_up,
           "decode_speed_up": decode, "check": check}
    stats = out.stats or {}
    rec.update({k: stats.get(k) for k in _STAT_KEYS})
    return rec


def run_bench(target, prompts: list[BenchPrompt], methods: list[Method], *, temperatures=(0.0,), max_new_tokens=128,
              repeats: int = 1, seed: int = 0, stop_at_eos: bool = True, warmup_tokens: int = 8,
              progress: bool = True, partial: Path | None = None) -> dict:
    """Run the benchmark; returns ``{"records": [...], "errors": [...], "seconds": ..., "estimate_seconds": ...}``.

    Each record carries ``rss_mb``, the process's resident memory right after that call (so a
    run whose memory grows shows at which prompt and method). With ``partial``, every record is
    also appended to that JSON-lines file as soon as its prompt turn is done, so a run that is
    killed keeps what it measured."""
    if not prompts:
        raise ValueError("no prompts selected")
    if not methods or methods[0].kind != "plain":
        raise ValueError("the first method must be our plain decoding (the reference of every ratio)")
    if max_new_tokens < 1 or repeats < 1:
        raise ValueError("max_new_tokens and repeats must be >= 1")
    inter = [m for m in methods if m.interleaved]
    external = [m for m in methods if not m.interleaved]
    plain, others = inter[0], inter[1:]
    t_start = time.perf_counter()

    # warm-up: allocator, first-call overheads, lazily built drafter state
    warm_ids = target.encode_chat([{"role": "user", "content": prompts[0].turns[0]}])
    per_call = {}  # method -> seconds of its first call (lazy setup: kernels, cost curve, drafter state)
    steady = {}  # method -> seconds of a second call: what the estimate scales (a first call's setup
    # scaled by every turn once announced 91 min for a 10-minute run)
    for m in inter:
        for T in temperatures:
            t0 = time.perf_counter()
            m.runner(warm_ids, warmup_tokens, T, seed, stop_at_eos)
            t1 = time.perf_counter()
            m.runner(warm_ids, warmup_tokens, T, seed, stop_at_eos)
            per_call[m.name] = t1 - t0
            steady[m.name] = steady.get(m.name, 0.0) + time.perf_counter() - t1
    turns = sum(len(p.turns) for p in prompts)
    est = sum(steady.values()) * (max_new_tokens / warmup_tokens) * turns * repeats
    _log(f"{len(prompts)} prompts ({turns} turns) x {len(inter)} interleaved methods x {len(temperatures)} "
         f"temperature(s) x {repeats} repeat(s), {max_new_tokens} new tokens: roughly {est / 60:.0f} min "
         f"(from the warm-up; EOS stops shorten it)")

    records, units, errors, order = [], [], [], 0
    for T in temperatures:
        for r in range(repeats):
            bar = tqdm(prompts, desc=f"T={T:g} repeat {r + 1}/{repeats}", file=sys.stderr, disable=not progress)
            for pi, p in enumerate(bar):
                history: list[dict] = []
                for ti, turn in enumerate(p.turns):
                    messages = history + [{"role": "user", "content": turn}]
                    ids = target.encode_chat(messages)
                    s = unit_seed(seed, r, p, ti)
                    unit = {"temperature": T, "repeat": r, "dataset": p.dataset, "category": p.category,
                            "question_id": p.question_id, "turn": ti, "prompt_tokens": len(ids), "seed": s}
                    k = (pi + ti) % len(others) if others else 0
                    outs: dict[str, tuple[RunResult, int, float | None]] = {}
                    for m in [plain] + others[k:] + others[:k]:
                        outs[m.name] = (m.runner(ids, max_new_tokens, T, s, stop_at_eos), order, rss_mb())
                        order += 1
                    base = outs[plain.name][0]
                    new = []
                    for m in inter:
                        out, o, rss = outs[m.name]
                        ref = outs.get(m.reference, (None,))[0]
                        new.append(make_record(unit, m, out, base, o, check_output(target, m, ids, out, ref, T)) | {"rss_mb": rss})
                    records += new
                    _append_partial(partial, new)
                    units.append({**unit, "prompt_ids": ids, "plain": base})
                    bar.set_postfix(rss_mb=f"{rss_mb() or 0:.0f}", refresh=False)
                    history = messages + [{"role": "assistant", "content": target.decode(base.token_ids)}]
    # out-of-process peers: same prompt ids, one engine per method and temperature
    ext_out: dict[tuple, RunResult] = {}
    for m in external:
        for T in temperatures:
            us = [u for u in units if u["temperature"] == T]
            _log(f"{m.name}: {len(us)} prompt turns at T={T:g} (separate engine, not interleaved) ...")
            try:
                outs = m.batch_runner([u["prompt_ids"] for u in us], max_new_tokens, T, [u["seed"] for u in us], stop_at_eos)
            except Exception as exc:  # an optional peer failing must not lose the rest of the run
                errors.append({"method": m.name, "temperature": T, "error": str(exc)[:2000]})
                _log(f"{m.name} failed: {str(exc)[:300]}")
                continue
            for u, out in zip(us, outs):
                key = (T, u["repeat"], u["dataset"], u["question_id"], u["turn"])
                ext_out[(m.name, *key)] = out
                ref = u["plain"] if m.reference == "plain" else ext_out.get((m.reference, *key))
                unit = {k: v for k, v in u.items() if k != "plain"}
                rec = make_record(unit, m, out, u["plain"], -1, check_output(target, m, u["prompt_ids"], out, ref, T))
                records.append(rec)
                _append_partial(partial, [rec])
    return {"records": records, "errors": errors, "seconds": time.perf_counter() - t_start, "estimate_seconds": est,
            "warmup_seconds": per_call}


def _append_partial(path: Path | None, records: list[dict]) -> None:
    if path is None:
        return
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
