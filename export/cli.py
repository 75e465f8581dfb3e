"""``specfoundry export``: turn a run into every deployable form and report what was written.

    specfoundry export [RUN] [--formats vllm,sglang,trtllm,hf_draft,onnx,ptx] [--engine trt] [--out DIR]
    specfoundry export --check DIR --target TARGET

Writes ``<run>/export/`` and ``<run>/export/export_report.json`` (what was written, parity
figures, what was skipped and why). ``--engine trt`` also builds TensorRT engines; where
TensorRT or a GPU is missing it exits non-zero with one sentence, after writing the rest.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ALL_FORMATS = ("vllm", "sglang", "trtllm", "hf_draft", "onnx", "ptx")


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="export a run to serving formats, ONNX and TensorRT")
    p.add_argument("run", nargs="?", default=None,
                   help="runs/<recipe> or a speculator checkpoint (default: an untrained EAGLE-3 head for the default target)")
    p.add_argument("--formats", default=",".join(ALL_FORMATS), help=f"comma list of {', '.join(ALL_FORMATS)}")
    p.add_argument("--engine", choices=["trt"], default=None, help="also build TensorRT engines")
    p.add_argument("--out", default=None, help="output directory (default: <run>/export)")
    p.add_argument("--target", default=None, help="target name/path (default: the one recorded in the run)")
    p.add_argument("--check", default=None, metavar="DIR", help="only check that an exported DIR belongs to --target")
    p.set_defaults(func=run_export)


def _check(args) -> int:
    from specfoundry.runtime.models import load_target

    from .identity import check_artifact

    if not args.target:
        raise ValueError("--check needs --target")
    check_artifact(Path(args.check), load_target(args.target))
    print(f"{args.check}: belongs to target {args.target}")
    return 0


def run_export(args) -> int:
    if args.check:
        return _check(args)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(ALL_FORMATS))
    if unknown:
        raise ValueError(f"unknown export format(s) {unknown}; choose from {list(ALL_FORMATS)}")

    from .serving import SERVING_FORMATS
    from .source import resolve_source

    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory")
    if args.run is not None and not Path(args.run).exists():
        raise FileNotFoundError(f"{args.run}: no such run directory or speculator checkpoint")
    src = resolve_source(args.run, args.target)
    out = Path(args.out) if args.out else src.run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "run": str(src.run_dir), "speculator": str(src.speculator_dir), "speculator_type": src.speculator_type,
        "trained": src.trained, "target": src.target.identity(), "written": {}, "skipped": {}, "parity": {},
    }
    if not src.trained:
        print("[export] note: exporting an UNTRAINED (random-init) speculator; train one with `make train`", file=sys.stderr)
    for fmt in formats:
        t0 = time.perf_counter()
        print(f"[export] {fmt} ...", file=sys.stderr)
        if fmt in SERVING_FORMATS:
            writer, _reader, types = SERVING_FORMATS[fmt]
            if src.speculator_type not in types:
                report["skipped"][fmt] = f"format {fmt} has no layout for {src.speculator_type} speculators"
                continue
            entry = writer(src.module, src.target, out / fmt)
        elif fmt == "onnx":
            from .onnx import export_all

            entry = export_all(src.target, src.module, out / "onnx")
            report["parity"]["onnx"] = entry.get("parity")
        elif fmt == "ptx":
            from .trt.aot import write_ptx

            entry = write_ptx(out / "trt")
        if isinstance(entry, dict) and entry.get("status") == "skipped":
            report["skipped"][fmt] = entry.get("reason", "skipped")
        else:
            report["written"][fmt] = entry
        print(f"[export] {fmt} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    code = 0
    if args.engine == "trt":
        from .trt.engine import EngineUnavailable, build_engines

        try:
            report["written"]["trt_engines"] = build_engines(out / "onnx", out / "trt")
        except EngineUnavailable as exc:
            report["skipped"]["trt_engines"] = str(exc)
            print(f"specfoundry: error: {exc}", file=sys.stderr)
            code = 1
    report_file = out / "export_report.json"
    report = _merged_with_previous(report, report_file)
    report_file.write_text(json.dumps(report, indent=2, default=str))
    print(f"[export] wrote {report_file}", file=sys.stderr)
    return code


def _merged_with_previous(report: dict, report_file: Path) -> dict:
    """A partial re-export (``--formats ptx``, ``--engine trt``) keeps the entries of formats it
    did not redo, when the earlier report is for the same speculator and target."""
    if not report_file.exists():
        return report
    try:
        old = json.loads(report_file.read_text())
    except ValueError:
        return report
    if any(old.get(k) != report[k] for k in ("speculator", "speculator_type", "target", "trained")):
        return report
    redone = set(report["written"]) | set(report["skipped"])
    for key in ("written", "skipped"):
        kept = {k: v for k, v in old.get(key, {}).items() if k not in redone}
        report[key] = {**kept, **report[key]}
    report["parity"] = {**{k: v for k, v in old.get("parity", {}).items() if k not in redone}, **report["parity"]}
    return report
