"""``specfoundry bench-serve``: the OpenAI-compatible server under closed-loop load.

Scope: load generation against real server processes on 127.0.0.1 and the report; nothing about
how the server decodes. Three servers run side by side (loaded once, idle while another is
measured): one with the load-aware policy, one with speculation forced on (``--speculation-table
1-:DEPTH``), one for "off" (the same command as load-aware's, ``speculate: false`` on every
request). "off" has a process of its own because the load-aware policy learns its costs and
acceptance from the steps it serves: plain requests on its server moved those estimates and cost
it 9-12% at 1 client in the seventeenth session's sweep. For each concurrency level the three
modes run back to back, so their ratios come from one run on one machine state; ``--rounds R``
runs each level R times per mode, the modes' order alternating (ABC CBA ...), and pools them (a
machine whose speed drifts over a level weighs on every mode alike).

Per mode and level: output tokens/s over the whole level and its steady rate (the tokens streamed
while every client was busy, i.e. before the first client found no request left: after that a
level's end is set by its last stragglers, which made short high-concurrency levels noisy), request latency, time to first token and time per output
token (p50/p99), τ from the responses' ``usage.speculative_decoding``, and the share of the CPU
the hypervisor stole while it ran (``/proc/stat``; on the shared development machine 10-50% for
minutes at a time: a row run under steal is slower for that reason alone). Every level is bounded in
requests and seconds and stops by itself. ``--soak SECONDS`` adds a mixed-load run against the
load-aware server (concurrency changing every 15 s, one stream in ten abandoned mid-way) that
counts errors and reports the server's resident memory at start and end.

``--peers vllm`` (issue 12) adds vLLM CPU's OpenAI-compatible server from ``.venv-vllm`` as two
more modes, ``vllm-off`` (the target alone) and ``vllm-on`` (with our EAGLE-3 head exported to
vLLM's format, ``num_speculative_tokens`` = ``--depth``): same target directory, dtype, max batch
and threads, driven by the same clients and prompts within the same level loop
(:mod:`specfoundry.bench.vllm_server`). All requests are greedy (T=0). A peer whose venv is absent
(or, for ``vllm-on``, without an eagle3 speculator) is listed as unavailable with the reason and
the rest runs; one that fails to start is listed with its error (exit code 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from .prompts import load_prompts, select

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "eval" / "spec_bench" / "question.jsonl"
DEFAULT_RUN = Path("runs/eagle3-smollm2-135m/speculator")
_MODELS: dict[str, str] = {}  # server URL -> the model id it serves


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-serve", help="throughput and latency of `specfoundry serve` vs concurrency "
                                                  "(speculation off / on / load-aware), loopback only")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--speculator", default=None,
                   help=f"speculator for the server (default: {DEFAULT_RUN} when it exists, else ngram)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma list of closed-loop client counts")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per mode, level and round (default: max(2 x concurrency, 16): fewer ended a level "
                        "in seconds on a 2-core machine, too short to average out its drift)")
    p.add_argument("--level-seconds", type=float, default=120.0, help="time bound per mode, level and round")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each level per mode, the modes' order alternating (ABC CBA ...); a mode's row "
                        "pools its rounds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=None,
                   help="draft depth of the always-on mode (default: a trained head's own, i.e. its measured "
                        "runtime shape's depth; 3 for other speculators)")
    p.add_argument("--prompt-lookup", type=int, default=2, metavar="N",
                   help="the servers' --prompt-lookup (prompt lookup first on an N-token match; 0: off)")
    p.add_argument("--data", default=None, help="prompt JSONL (default: Spec-Bench when ../shared has it)")
    p.add_argument("--modes", default="off,on,load-aware")
    p.add_argument("--peers", default="", help="other servers under the same load: vllm (= vllm-off,vllm-on), "
                                               "vllm-off, vllm-on; needs .venv-vllm (SPECFOUNDRY_VLLM_VENV)")
    p.add_argument("--soak", type=float, default=0.0, help="seconds of mixed load after the sweep (0 = none)")
    p.add_argument("--max-batch", type=int, default=0, help="server batch size (default: the largest concurrency)")
    p.add_argument("--out", default=None, help="output directory (default: runs/bench-serve/<timestamp>)")
    p.set_defaults(func=main)


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _model_id(url: str) -> str:
    """The model name the server answers to (its ``/v1/models``)."""
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


async def _one(client, url: str, messages: list[dict], max_tokens: int, speculate: bool | None,
               abandon_after: int | None = None) -> dict:
    """One streamed chat completion; timings from the client's side. ``speculate`` None: the
    field is not sent (a server that does not know it, e.g. vLLM)."""
    body = {"model": _MODELS[url], "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if speculate is not None:
        body["speculate"] = speculate
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
                if abandon_after is not None and chunks >= abandon_after:
                    return {"abandoned": True}
    end = time.perf_counter()
    if usage is None:
        return {"error": "no usage chunk"}
    n = usage["completion_tokens"]
    spec = usage.get("speculative_decoding") or {}
    return {"tokens": n, "latency": end - t0, "ttft": (first or end) - t0, "t_first": first or end, "t_end": end,
            "tpot": ((end - first) / (n - 1)) if first is not None and n > 1 else None,
            "tau": spec.get("tau"), "forwards": n / spec["tau"] if spec.get("tau") else None}


async def _level(url: str, prompts: list[list[dict]], concurrency: int, requests: int, seconds: float,
                 max_tokens: int, speculate: bool | None, start: int = 0) -> dict:
    """``concurrency`` closed-loop clients until ``requests`` finished or ``seconds`` passed, over
    ``prompts[start:]`` (wrapping around): the level's row (:func:`summarise` of one run)."""
    return summarise(concurrency, [await _run(url, prompts, concurrency, requests, seconds, max_tokens, speculate,
                                              start)])


async def _run(url: str, prompts: list[list[dict]], concurrency: int, requests: int, seconds: float,
               max_tokens: int, speculate: bool | None, start: int = 0) -> dict:
    """One run of a level: the responses, the errors, its wall time, and its steady part: the
    tokens streamed before the first client found no request left (``drain``), while all
    ``concurrency`` clients were busy (after that the level's end is set by its stragglers)."""
    import httpx

    from .measure import cpu_ticks, steal_fraction

    results, errors = [], []
    next_i = 0
    drain = None
    deadline = time.perf_counter() + seconds
    ticks = cpu_ticks()
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(seconds + 60), limits=limits) as client:
        async def worker():
            nonlocal next_i, drain
            while next_i < requests and time.perf_counter() < deadline:
                i = next_i
                next_i += 1
                r = await _one(client, url, prompts[(start + i) % len(prompts)], max_tokens, speculate)
                (errors if "error" in r else results).append(r)
            drain = drain or time.perf_counter()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    end = time.perf_counter()
    return {"results": results, "errors": errors, "seconds": end - t0, "steady_seconds": (drain or end) - t0,
            "steady_tokens": sum(tokens_before(r, drain or end) for r in results),
            "steal": steal_fraction(ticks, cpu_ticks())}


def tokens_before(r: dict, t: float) -> float:
    """Tokens of response ``r`` streamed before time ``t``: its first at ``t_first``, the rest
    spread evenly up to ``t_end``."""
    if t >= r["t_end"]:
        return r["tokens"]
    if t < r["t_first"]:
        return 0.0
    return 1 + (r["tokens"] - 1) * (t - r["t_first"]) / max(r["t_end"] - r["t_first"], 1e-9)


def summarise(concurrency: int, runs: list[dict]) -> dict:
    """A level's row from one or more runs of it (``--rounds``): rates over the runs' summed
    tokens and seconds, percentiles over all their requests."""
    results = [r for run in runs for r in run["results"]]
    errors = [e for run in runs for e in run["errors"]]
    wall = sum(run["seconds"] for run in runs)
    steady = sum(run["steady_seconds"] for run in runs)
    tokens = sum(r["tokens"] for r in results)
    forwards = sum(r["forwards"] or 0 for r in results)
    stolen = [(run["steal"], run["seconds"]) for run in runs if run.get("steal") is not None]
    stolen_s = sum(t for _, t in stolen)
    return {
        "concurrency": concurrency, "rounds": len(runs), "requests": len(results), "errors": len(errors),
        "error_samples": errors[:3], "seconds": wall, "tokens": tokens,
        "output_tok_s": tokens / wall if wall else 0.0,
        "steady_tok_s": sum(run["steady_tokens"] for run in runs) / steady if steady else 0.0,
        "tau": tokens / forwards if forwards else None,
        # the CPU time the hypervisor took while this level ran (seconds-weighted over its runs)
        "steal": sum(f * t for f, t in stolen) / stolen_s if stolen_s else None,
        "latency_p50": _percentile([r["latency"] for r in results], 0.5),
        "latency_p99": _percentile([r["latency"] for r in results], 0.99),
        "ttft_p50": _percentile([r["ttft"] for r in results], 0.5),
        "ttft_p99": _percentile([r["ttft"] for r in results], 0.99),
        "tpot_p50": _percentile([r["tpot"] for r in results if r["tpot"]], 0.5),
        "tpot_p99": _percentile([r["tpot"] for r in results if r["tpot"]], 0.99),
    }


async def _rss(client, url: str) -> float | None:
    """The server's resident memory (MB) from its /metrics (process collector), if it reports it."""
    r = await client.get(url + "/metrics")
    for line in r.text.splitlines():
        if line.startswith("process_resident_memory_bytes"):
            return float(line.split()[-1]) / 2**20
    return None


async def _soak(url: str, prompts: list[list[dict]], seconds: float, max_tokens: int, max_c: int) -> dict:
    """Mixed load for ``seconds``: concurrency redrawn every 15 s, one stream in ten abandoned."""
    import httpx

    rng = random.Random(0)
    counts = {"completed": 0, "abandoned": 0, "errors": 0}
    samples = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as client:
        rss_start = await _rss(client, url)
        t0 = time.perf_counter()
        t_end = t0 + seconds
        rss_samples = [(0.0, rss_start, 0)]  # (seconds into the soak, MB, concurrency) after every phase
        i = 0
        while time.perf_counter() < t_end:
            c = rng.choice([1, 2, 4, max_c])
            phase_end = min(t_end, time.perf_counter() + 15)

            async def worker():
                nonlocal i
                while time.perf_counter() < phase_end:
                    i += 1
                    abandon = rng.randint(1, 4) if rng.random() < 0.1 else None
                    r = await _one(client, url, prompts[i % len(prompts)], max_tokens, True, abandon)
                    if "error" in r:
                        counts["errors"] += 1
                        samples.append(r["error"])
                    else:
                        counts["abandoned" if r.get("abandoned") else "completed"] += 1

            await asyncio.gather(*(worker() for _ in range(c)))
            # the phase's concurrency beside it: a level seen for the first time brings new shapes
            rss_samples.append((round(time.perf_counter() - t0, 1), await _rss(client, url), c))
        await asyncio.sleep(1.0)  # let abandoned streams' slots free
        health = (await client.get(url + "/health")).json()
        rss_end = await _rss(client, url)
    return {"seconds": seconds, **counts, "error_samples": samples[:3], "rss_start_mb": rss_start,
            "rss_end_mb": rss_end, "rss_samples": rss_samples, **rss_trend(rss_samples), "health_after": health}


def rss_trend(samples: list[tuple]) -> dict:
    """Growth of resident memory over a soak from ``(seconds, MB or None, ...)`` samples, split in
    halves: warm-up growth (new shapes, caches)
    lands in the first half; a leak keeps growing in the second. The second half's growth is its
    least-squares slope (MB per minute, and times the half's span): single samples swing by the
    phase just served (+-80 MB between a 32-client and a 1-client phase at max batch 32, twelfth
    session), so two end points read a swing as growth or shrinkage."""
    pts = [(t, mb) for t, mb, *_ in samples if mb is not None]
    if len(pts) < 3:
        return {"rss_first_half_mb": None, "rss_second_half_mb": None, "rss_second_half_mb_per_min": None}
    mid = pts[-1][0] / 2
    half = min(pts, key=lambda p: abs(p[0] - mid))
    tail = [p for p in pts if p[0] >= half[0]]
    span = pts[-1][0] - half[0]
    slope = None
    if len(tail) >= 2 and span > 0:
        tm, ym = sum(t for t, _ in tail) / len(tail), sum(y for _, y in tail) / len(tail)
        slope = sum((t - tm) * (y - ym) for t, y in tail) / sum((t - tm) ** 2 for t, _ in tail)  # MB per second
    return {"rss_first_half_mb": round(half[1] - pts[0][1], 1),
            "rss_second_half_mb": round(slope * span, 1) if slope is not None else None,
            "rss_second_half_mb_per_min": round(60 * slope, 1) if slope is not None else None}


def _plot(levels: dict, path: Path) -> Path | None:
    try:
        from .plots import _plt, _save
        plt = _plt()
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, rows in levels.items():
        xs = [r["concurrency"] for r in rows]
        axes[0].plot(xs, [r["output_tok_s"] for r in rows], marker="o", label=mode)
        axes[1].plot(xs, [r["tpot_p50"] or 0 for r in rows], marker="o", label=mode)
    for ax, title in zip(axes, ("output tokens/s vs concurrency", "time per output token p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, path)


def _baseline(mode: str) -> str:
    """The "off" row a mode's "vs off" ratio divides by: the same server family's."""
    return "vllm-off" if mode.startswith("vllm") else "off"


def _table(levels: dict) -> str:
    lines = ["| clients | mode | tok/s | vs off | steady tok/s | vs off | τ | latency p50/p99 s | TTFT p50/p99 s | "
             "TPOT p50/p99 ms | CPU stolen | done | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    conc = sorted({r["concurrency"] for rows in levels.values() for r in rows})
    offs = {b: {r["concurrency"]: r for r in levels.get(b, [])} for b in ("off", "vllm-off")}

    def f(x, s="{:.2f}"):
        return "-" if x is None else s.format(x)

    for c in conc:
        for mode, rows in levels.items():
            r = next((r for r in rows if r["concurrency"] == c), None)
            if r is None:
                continue
            off = offs[_baseline(mode)].get(c)
            ratio, steady = (None, None) if not off else \
                (r["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None,
                 r["steady_tok_s"] / off["steady_tok_s"] if off.get("steady_tok_s") else None)
            lines.append(f"| {c} | {mode} | {r['output_tok_s']:.1f} | {f(ratio)}x | {f(r.get('steady_tok_s'), '{:.1f}')} | "
                         f"{f(steady)}x | {f(r['tau'])} | "
                         f"{f(r['latency_p50'])}/{f(r['latency_p99'])} | {f(r['ttft_p50'])}/{f(r['ttft_p99'])} | "
                         f"{f(r['tpot_p50'] and r['tpot_p50'] * 1e3, '{:.1f}')}/{f(r['tpot_p99'] and r['tpot_p99'] * 1e3, '{:.1f}')} | "
                         f"{f(None if r.get('steal') is None else 100 * r['steal'], '{:.0f}%')} | "
                         f"{r['requests']} | {r['errors']} |")
    return "\n".join(lines)


def head_depth(speculator: str, default: int = 3) -> int:
    """The depth a trained EAGLE head drafts when its caller names none (its measured runtime shape,
    else its τ shape: what ``load_drafter`` uses); ``default`` for other speculators."""
    from ..runtime.speculators.checkpoint import default_draft_shape, read_config

    path = Path(speculator)
    try:
        is_head = "speculator_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):  # ngram, a draft model's HF config: not a speculator checkpoint
        is_head = False
    if not is_head:
        return default
    return int(default_draft_shape(read_config(path))[0].get("depth", default))


def main(args) -> int:
    from ..runtime.serving.launch import serve_subprocess
    from . import vllm_server

    levels_c = [int(c) for c in args.concurrency.split(",")]
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"off", "on", "load-aware"}
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}: choose from off, on, load-aware")
    peer_modes = vllm_server.peer_modes(getattr(args, "peers", ""))
    speculator = args.speculator or (str(DEFAULT_RUN) if (DEFAULT_RUN / "config.json").exists() else "ngram")
    if args.depth is None:
        args.depth = head_depth(speculator)
    data = args.data or (str(SPEC_BENCH) if SPEC_BENCH.exists() else None)
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in select(load_prompts(data), None, None)]
    random.Random(0).shuffle(prompts)
    out = Path(args.out or f"runs/bench-serve/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    max_c = args.max_batch or max(levels_c)
    common = ["--target", args.target, "--speculator", speculator, "--dtype", args.dtype, "--threads",
              str(args.threads), "--max-batch", str(max_c), "--max-queue", str(max_c), "--prompt-lookup",
              str(args.prompt_lookup)]
    print(f"bench-serve: {args.target} ({args.dtype}, {args.threads} threads) + {speculator}; levels {levels_c}; "
          f"modes {modes + peer_modes}; {len(prompts)} prompts from {data or 'the built-in set'}", flush=True)
    peers = vllm_server.availability(peer_modes, args.dtype, speculator)
    for mode, st in peers.items():
        print(f"  peer {mode}: " + (f"vLLM {st['version']} ({st['python']})" if st["available"]
                                     else f"unavailable: {st['reason']}"), flush=True)
    if not modes and not any(st["available"] for st in peers.values()):
        raise SystemExit("nothing to measure: no mode of ours and no available peer")
    from contextlib import ExitStack

    levels: dict[str, list] = {m: [] for m in modes}
    with ExitStack() as stack:
        aware = stack.enter_context(serve_subprocess(common)) if "load-aware" in modes else None
        on = stack.enter_context(serve_subprocess(common + ["--speculation-table", f"1-:{args.depth}"])) \
            if "on" in modes else None
        off = stack.enter_context(serve_subprocess(common)) if "off" in modes else None
        urls = {"off": off, "on": on, "load-aware": aware}
        speculate = {"off": False, "on": True, "load-aware": True}
        for mode, st in peers.items():
            if not st["available"]:
                continue
            try:
                head = None
                if mode == "vllm-on":
                    head = vllm_server.export_head(args.target, speculator, args.depth, out / "vllm_speculator")
                    st["head"] = str(head)
                print(f"  starting {mode} (vLLM, log {out / (mode + '.log')}) ...", flush=True)
                t0 = time.perf_counter()
                urls[mode] = stack.enter_context(vllm_server.vllm_server(
                    mode, model=str(vllm_server.target_dir(args.target)), dtype=args.dtype, max_num_seqs=max_c,
                    threads=args.threads, head_dir=head, depth=args.depth, log=out / f"{mode}.log"))
                st.update(started=True, startup_seconds=round(time.perf_counter() - t0, 1), log=str(out / f"{mode}.log"))
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                head_line, _, tail = (str(exc).strip() or type(exc).__name__).partition("\n")
                last = [ln.strip() for ln in tail.splitlines() if ln.strip()]
                # the launcher's "<what happened>: <command>\n<log tail>" as what happened + the log's last line
                first = head_line.split(": ", 1)[0] + f": {last[-1][:300]}" if last else head_line
                st.update(started=False, error=first, log=str(out / f"{mode}.log"))
                print(f"  peer {mode}: failed to start: {first}", flush=True)
                continue
            speculate[mode] = None  # vLLM does not know our per-request field
            levels[mode] = []
        run_modes = [m for m in levels]
        for url in {urls[m] for m in run_modes}:
            _MODELS[url] = _model_id(url)
        # one warm-up request per server (first-call costs are not load), with the last prompt; each
        # level then takes the next unused prompts, the same for every mode: a server with a prefix
        # cache (vLLM's is on by default) must not be served prompts it has already seen
        for url in {urls[m] for m in run_modes}:
            asyncio.run(_level(url, prompts, 1, 1, 60, 8, True if url in (off, aware, on) else None, start=len(prompts) - 1))
        start = 0
        for c in levels_c:
            n = args.requests or max(2 * c, 16)
            runs: dict[str, list] = {m: [] for m in run_modes}
            before = {m: vllm_server.spec_counters(urls[m]) for m in run_modes if m == "vllm-on"}
            for r in range(args.rounds):
                # rounds alternate the modes' order (ABC CBA ...): a drift of the machine over the level
                # weighs on every mode alike; each round serves the next unused prompts to every mode
                for mode in (run_modes if r % 2 == 0 else run_modes[::-1]):
                    runs[mode].append(asyncio.run(_run(urls[mode], prompts, c, n, args.level_seconds, args.max_tokens,
                                                       speculate[mode], start=start)))
                start += n
            for mode in run_modes:
                row = summarise(c, runs[mode])
                if mode in before:
                    vllm_server.add_tau(row, before[mode], vllm_server.spec_counters(urls[mode]))
                levels[mode].append(row)
                print(f"  {c:>3} clients  {mode:<10} {row['output_tok_s']:7.1f} tok/s  steady {row['steady_tok_s']:7.1f}  "
                      f"tau {row['tau'] or 0:.2f}  done {row['requests']}  errors {row['errors']}"
                      + (f"  CPU stolen {100 * row['steal']:.0f}%" if row.get("steal") is not None else ""), flush=True)
        soak_url = aware or off or on  # the soak wants the load-aware server; any of ours will do without it
        soak = asyncio.run(_soak(soak_url, prompts, args.soak, args.max_tokens, max_c)) if args.soak and soak_url else None
    report = {"args": vars(args) | {"func": None}, "speculator": speculator, "levels": levels, "peers": peers,
              "servers": {m: urls[m] for m in levels}, "soak": soak}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    md = [f"# bench-serve: {args.target} + {speculator}", "", _table(levels)]
    if peers:
        md += ["", f"Peers (T=0 only; vs off: against the same server's off row; vLLM τ = output tokens / "
                   f"(spec-decode drafts + requests) from its /metrics, max-num-seqs {max_c}, {args.dtype}, "
                   f"{args.threads} threads):"]
        for mode, st in peers.items():
            if not st["available"]:
                md.append(f"- {mode}: unavailable: {st['reason']}")
            elif not st.get("started"):
                md.append(f"- {mode}: failed to start: {st['error']} (log {st['log']})")
            else:
                md.append(f"- {mode}: vLLM {st['version']} OpenAI server, started in {st['startup_seconds']} s"
                          + (f", our EAGLE-3 head exported to {st['head']}, num_speculative_tokens {args.depth}"
                             if mode == "vllm-on" else ", no speculation"))
    if soak:
        md += ["", f"soak {soak['seconds']:.0f} s: completed {soak['completed']}, abandoned {soak['abandoned']}, "
                   f"errors {soak['errors']}, RSS {soak['rss_start_mb']} -> {soak['rss_end_mb']} MB "
                   f"(first half +{soak['rss_first_half_mb']} MB, second half +{soak['rss_second_half_mb']} MB, "
                   f"{soak['rss_second_half_mb_per_min']} MB/min)"]
    plot = _plot(levels, out / "throughput.png")
    (out / "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[2:]))
    print(f"report: {out / 'report.md'}" + (f", plot: {plot}" if plot else ""))
    errors = sum(r["errors"] for rows in levels.values() for r in rows) + (soak["errors"] if soak else 0)
    failed = sum(1 for st in peers.values() if st["available"] and not st.get("started"))
    return 1 if errors or failed else 0
