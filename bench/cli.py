"""``specfoundry bench``: benchmark our decoding methods and peers on prompt sets.

    specfoundry bench [--run runs/<recipe> ...] [--data FILE ...] [--categories C,...] [--limit N]
        [--methods SPEC,...] [--peers auto|none|hf,hf-lookup,hf-assisted,vllm,vllm-eagle3,llamacpp,llamacpp-lookup]
        [--temperature 0 1] [--max-new-tokens N] [--repeats N] [--target T] [--out DIR]
    specfoundry bench --render DIR            # re-summarise a report.json
    specfoundry bench --merge DIR DIR ... --out DIR   # pool runs split by category/temperature

Writes ``runs/bench/<timestamp>/``: ``report.json``, ``report.md`` and three PNG plots. Exit code
0 when every checked greedy output equals its reference (near-ties aside), 1 on a lossless
violation. Method specs: see :mod:`specfoundry.bench.methods`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_PEERS = ("hf", "hf-lookup", "hf-assisted", "vllm", "vllm-eagle3", "llamacpp", "llamacpp-lookup")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark decoding methods and peers (report.json, report.md, plots)")
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="a training run (runs/<recipe>, holding speculator/); repeatable")
    p.add_argument("--data", action="append", default=[], metavar="FILE",
                   help="prompt JSONL (Spec-Bench/MT-bench turns, HumanEval, GSM8K, plain prompt); repeatable; "
                        "default: the built-in set")
    p.add_argument("--categories", default=None, help="comma list of categories (or dataset:category)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts per category")
    p.add_argument("--first-turn-only", action="store_true", help="only the first turn of multi-turn prompts")
    p.add_argument("--methods", default="auto",
                   help="comma list of SOURCE[:SHAPE][@DEPTH] (plain, ngram, draft, medusa, eagle, eagle3, a run's "
                        "type; shapes chain/static/dynamic/adaptive) and hf peers; 'auto' = plain, ngram, draft and "
                        "every run's type in all shapes")
    p.add_argument("--peers", default="auto",
                   help=f"comma list of {', '.join(DEFAULT_PEERS)}; 'auto' = all (those not installed are listed "
                        "as unavailable); 'none'")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="one or more (default: 0 1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--target", default="smollm2-135m", help="built-in target name or local HF directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"],
                   help="auto (default): the dtype whose plain decoding is fastest here (measured at load), so "
                        "speed-ups count against the fastest plain decoding")
    p.add_argument("--backend", default="auto", choices=["auto", "engine", "hf"],
                   help="our decoding path: the static-cache engine (auto: where the architecture allows) or HF's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=None, help="output directory (default: runs/bench/<timestamp>)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--render", metavar="DIR", default=None,
                   help="re-summarise an existing DIR/report.json (tables, plots, report.md) without running anything")
    p.add_argument("--merge", metavar="DIR", nargs="+", default=None,
                   help="pool the records of several runs with the same methods and settings (e.g. parts split by "
                        "category or temperature) into one report in --out; runs nothing")
    p.set_defaults(func=run_cli)
    from .check_vllm import register as register_check_vllm

    register_check_vllm(subparsers)  # `specfoundry check-vllm` (make check-vllm)
    from .tune_shape import register as register_tune_shape

    register_tune_shape(subparsers)  # `specfoundry tune-shape`


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if sha.returncode:
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def environment() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count() or 0, "torch_threads": torch.get_num_threads(), "git_commit": _git_commit()}


def _split(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def build_methods(factory, target, target_source: str, specs: str, peers: str, work: Path):
    """(methods, unavailable): ours and in-process peers from ``specs``, then external peers."""
    from .external import availability, external_method
    from .methods import EXTERNAL_PEERS, HF_PEERS, parse_spec

    wanted = factory.default_specs() if specs == "auto" else _split(specs)
    if not wanted:
        raise ValueError("--methods is empty")
    if "plain" not in wanted:
        wanted.insert(0, "plain")
    peer_specs = list(DEFAULT_PEERS) if peers == "auto" else ([] if peers == "none" else _split(peers))
    for ps in peer_specs:
        if parse_spec(ps)[0] not in HF_PEERS + EXTERNAL_PEERS:
            raise ValueError(f"unknown peer {ps!r}: choose from {list(DEFAULT_PEERS)} (or 'auto', 'none')")
    methods, seen = [factory.plain()], {"plain"}
    for spec in [w for w in wanted if w != "plain"] + [p for p in peer_specs if parse_spec(p)[0] in HF_PEERS]:
        m = factory.build(spec)
        if m.name in seen and specs == "auto":
            continue  # e.g. a run's runtime shape that is also one of its listed shapes
        if m.name in seen:
            raise ValueError(f"method {m.name!r} listed twice")
        seen.add(m.name)
        methods.append(m)
    unavailable = []
    eagle3 = factory.sources.get("eagle3")
    # a peer compared with another peer's output runs after it
    ext = sorted((p for p in peer_specs if parse_spec(p)[0] in EXTERNAL_PEERS),
                 key=lambda p: parse_spec(p)[0] in ("vllm-eagle3", "llamacpp-lookup"))
    for spec in ext:
        name, _, depth, _ = parse_spec(spec)
        ok, reason = availability(name, target_source, bool(eagle3 and eagle3.trained), str(target.dtype).replace("torch.", ""))
        if not ok:
            unavailable.append({"name": name, "reason": reason})
            continue
        methods.append(external_method(name, depth, target, target_source, work, eagle3))
    return methods, unavailable


def run_cli(args) -> int:
    if args.render:
        return render_existing(Path(args.render))
    if args.merge:
        return merge_existing([Path(d) for d in args.merge], args.out)
    import torch

    from specfoundry.runtime.cli import DTYPES
    from specfoundry.runtime.models import load_target

    from .measure import run_bench
    from .methods import MethodFactory
    from .prompts import load_prompts, select

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if any(t < 0 for t in args.temperature):
        raise ValueError(f"--temperature values must be >= 0, got {args.temperature}")
    if args.threads:
        torch.set_num_threads(args.threads)
    temps = sorted(set(float(t) for t in args.temperature))
    prompts = []
    for f in args.data or [None]:
        prompts += load_prompts(f)
    prompts = select(prompts, _split(args.categories) or None, args.limit)
    if args.first_turn_only:
        prompts = [type(p)(p.dataset, p.question_id, p.category, p.turns[:1]) for p in prompts]
    if not prompts:
        raise ValueError("no prompts selected")
    out = Path(args.out) if args.out else Path("runs") / "bench" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    target = load_target(args.target, device=args.device, dtype=DTYPES[args.dtype], backend=args.backend)
    factory = MethodFactory(target, args.run)
    methods, unavailable = build_methods(factory, target, args.target, args.methods, args.peers, out / "engines")
    from .plain_kernels import apply_plain_kernels, kernels_name, plain_kernel_choice

    # speed-ups count against the fastest plain decoding: on the products that decode fastest here
    choice = plain_kernel_choice(target, target.encode_chat([{"role": "user", "content": prompts[0].turns[0]}]))
    # the engine's kernels are measured at a machine's first load, then kept (runtime/choices.py): say which
    kernels_from = target._engine().kernels_from if hasattr(target, "_engine") else None
    if kernels_from is not None:
        print(f"[bench] engine kernels {kernels_name(choice['engine'])}: {kernels_from}", file=sys.stderr)
    if choice["ms_per_token"]:
        print("[bench] plain decoding by products: " + ", ".join(
            f"{kernels_name(k)} {ms:.2f} ms/token" for k, ms in choice["ms_per_token"].items())
            + f"; plain runs on {kernels_name(choice['plain'])}, the speculative methods on the engine's "
              f"{kernels_name(choice['engine'])}", file=sys.stderr)
    methods = apply_plain_kernels(methods, target, choice)
    for u in unavailable:
        print(f"[bench] {u['name']}: {u['reason']}", file=sys.stderr)
    env = environment()  # before the run: the commit and threads that measured, not those at the end
    from .floor import read_bandwidth_gbs, weight_streaming_floor

    before = read_bandwidth_gbs()  # same threads as the run, before it starts
    floor = weight_streaming_floor(target.model, before)
    print(f"[bench] weight-streaming floor: {floor['read_gbs']:.1f} GB/s, {floor['weight_bytes'] / 1e6:.0f} MB "
          f"-> {floor['floor_ms']:.1f} ms per token (read again after the run)", file=sys.stderr)
    raw = run_bench(target, prompts, methods, temperatures=temps, max_new_tokens=args.max_new_tokens,
                    repeats=args.repeats, seed=args.seed, stop_at_eos=not args.ignore_eos, progress=not args.no_progress,
                    partial=_fresh(out / "records.partial.jsonl"))
    described = [m.describe() | ({"warmup_seconds": raw["warmup_seconds"][m.name]}
                                  if m.name in raw.get("warmup_seconds", {}) else {}) for m in methods]
    # the floor is the best the machine showed: one reading at the start moves with the machine's load by more
    # than plain decoding's distance from it (forty-ninth session: 11.4 and 13.9 GB/s an hour apart)
    readings = [before, read_bandwidth_gbs()]
    raw["floor"] = weight_streaming_floor(target.model, max(readings)) | {"readings_gbs": readings}
    return write_report(out, raw, described, unavailable, {
        "target": args.target, "dtype": str(target.dtype).removeprefix("torch."), "backend": target.backend, "temperatures": temps, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "seed": args.seed, "stop_at_eos": not args.ignore_eos,
        "datasets": sorted({p.dataset for p in prompts}), "limit": args.limit, "runs": [str(r) for r in args.run],
        "categories": sorted({p.key for p in prompts}), "prompts": len(prompts),
        "turns": sum(len(p.turns) for p in prompts), "device": args.device,
        "kernels": {"engine": kernels_name(choice["engine"]), "engine_from": kernels_from,
                    "plain": kernels_name(choice["plain"]),
                    "plain_ms_per_token": {kernels_name(k): ms for k, ms in choice["ms_per_token"].items()}}}, env)


def _fresh(path: Path) -> Path:
    """A records file for this run: an older one in the same directory is removed first."""
    path.unlink(missing_ok=True)
    return path


def render_existing(out: Path) -> int:
    """``--render``: rebuild summary, failures, plots and report.md from ``out/report.json``'s records
    (e.g. after an upgrade added a column); the measurements and the environment are kept."""
    import json

    path = Path(out) / "report.json"
    if not path.is_file():
        raise SystemExit(f"specfoundry bench --render: no report.json in {out}")
    rc = _finish(json.loads(path.read_text()), Path(out))
    print(f"[bench] re-rendered {Path(out) / 'report.md'}", file=sys.stderr)
    return rc


def merge_existing(dirs: list[Path], out: str | None) -> int:
    """``--merge``: one report in ``out`` from the records of several runs (see :mod:`.merge`)."""
    from .merge import merge_reports

    if not out:
        raise ValueError("--merge needs --out DIR for the merged report")
    report = merge_reports(dirs)
    Path(out).mkdir(parents=True, exist_ok=True)
    rc = _finish(report, Path(out))
    print(f"[bench] merged {len(dirs)} runs into {Path(out) / 'report.md'}", file=sys.stderr)
    return rc


def _finish(report: dict, out: Path, validate: bool = True) -> int:
    """Summary, failures, plots, (validation,) report.json and report.md for ``report``'s records;
    0 when passed, 1 otherwise. A fresh run is written unvalidated: its measurements are never lost."""
    from .report import failures_of, summarize, to_markdown, validate_report, write_json

    report["summary"] = summarize(report["records"], report["methods"])
    report["failures"] = failures_of(report["records"])
    report["passed"] = not report["failures"]
    report["files"] = {"json": str(out / "report.json"), "markdown": str(out / "report.md"),
                       "plots": report["files"].get("plots", [])}
    try:
        from .plots import write_plots

        report["files"]["plots"] = [str(p) for p in write_plots(report["summary"], report["methods"], out)]
    except ImportError as exc:  # matplotlib is optional for the runtime install
        if not any(u["name"] == "plots" for u in report["unavailable"]):
            report["unavailable"].append({"name": "plots", "reason": f"matplotlib not importable ({exc})"})
    if validate:
        problems = validate_report(report)
        if problems:
            raise SystemExit(f"specfoundry bench: {out / 'report.json'} would not be a valid report: {problems[0]}")
    write_json(report, out / "report.json")
    (out / "report.md").write_text(to_markdown(report))
    return 0 if report["passed"] else 1


def write_report(out: Path, raw: dict, methods: list[dict], unavailable: list[dict], settings: dict,
                 env: dict | None = None) -> int:
    """Write report.json, the plots and report.md into ``out``; 0 when passed, 1 otherwise."""
    from .report import SCHEMA_ID

    report = {"schema": SCHEMA_ID, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "passed": True, "environment": env or environment(), "settings": settings, "methods": methods,
              "unavailable": unavailable, "errors": raw["errors"], "seconds": raw["seconds"], "records": raw["records"],
              "summary": {}, "failures": [], "files": {}}
    if raw.get("floor"):
        report["floor"] = raw["floor"]
    rc = _finish(report, out, validate=False)
    print(f"[bench] wrote {out / 'report.md'} and report.json ({raw['seconds'] / 60:.1f} min)", file=sys.stderr)
    if report["failures"]:
        print(f"[bench] FAIL: {len(report['failures'])} lossless violation(s); see {out / 'report.md'}", file=sys.stderr)
    return rc
