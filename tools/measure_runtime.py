"""Thin wrapper kept for the command in docs/results.md: runs ``specfoundry bench`` (the
benchmark harness, ``specfoundry.bench``) with plain decoding and the given drafters on the
built-in prompt set, greedy, and prints its report.md.

    .venv/bin/python tools/measure_runtime.py --prompts 12 --max-new-tokens 128 [--drafter ngram] [--no-adaptive]

``--prompts N`` takes the first ceil(N / 6) prompts of each of the six built-in categories.
For everything else (Spec-Bench files, trained runs, peers, T=1) use ``specfoundry bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

from specfoundry.runtime.cli import main as specfoundry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", default=None, help="repeatable drafter type; default: ngram")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-adaptive", action="store_true")
    ap.add_argument("--json", default=None, help="also copy report.json to this file")
    args = ap.parse_args()
    shape = lambda d: f"{d}:{'adaptive' if not args.no_adaptive else ('dynamic' if d.startswith('eagle') else 'static' if d == 'medusa' else 'chain')}"
    methods = ",".join(["plain"] + [shape(d) for d in (args.drafter or ["ngram"])])
    out = Path(tempfile.mkdtemp(prefix="measure-runtime-"))
    rc = specfoundry(["bench", "--target", args.target, "--methods", methods, "--peers", "none", "--temperature", "0",
                      "--limit", str(max(1, math.ceil(args.prompts / 6))), "--max-new-tokens", str(args.max_new_tokens),
                      "--ignore-eos", "--out", str(out)])
    if (out / "report.md").exists():
        print((out / "report.md").read_text())
        if args.json:
            shutil.copy(out / "report.json", args.json)
            json.loads(Path(args.json).read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
