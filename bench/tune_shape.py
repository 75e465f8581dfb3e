"""``specfoundry tune-shape``: measure a trained EAGLE head's fastest draft shape on this machine
and store it as the checkpoint's runtime default (``training.runtime_shape``), and the temperature
its drafts are drawn at for sampling requests (``training.draft_temperature``, runtime/calibrate.py).

    specfoundry tune-shape --speculator runs/<recipe>/speculator [--data FILE] [--limit N]
        [--shapes adaptive,chain@2,chain@3,tree@2/4,...] [--draft-temperatures 0.7,1.0] [--threads N] [--dry-run]

Prints ``{"runtime_shape": ..., "draft_temperature": ...}``; an empty ``--shapes`` or ``--draft-temperatures``
skips that measurement (null; the checkpoint keeps what it had).

The training run already measures this on its held-out prompts, on the machine it trained on;
re-run it on the machine that serves (the best shape follows that machine's cost curve). Prompts:
first turns of ``--data`` (default: the built-in bench set), ``--limit`` of them in file order
across categories. See :mod:`specfoundry.runtime.tune`.
"""

from __future__ import annotations

import json
import sys


def register(subparsers) -> None:
    from specfoundry.runtime.adaptive import RUNTIME_SHAPE_CANDIDATES
    from specfoundry.runtime.cli import DTYPES

    p = subparsers.add_parser("tune-shape", help="measure a trained EAGLE head's fastest draft shape here and the "
                                                 "temperature it drafts at for sampling, and store them as its defaults")
    p.add_argument("--speculator", required=True, metavar="DIR", help="an eagle/eagle3 checkpoint directory")
    p.add_argument("--target", default="smollm2-135m", help="the target it belongs to (built-in name, HF id or path)")
    p.add_argument("--data", default=None, metavar="FILE", help="prompt JSONL (default: the built-in bench set)")
    p.add_argument("--limit", type=int, default=12, help="prompts to time (default 12)")
    p.add_argument("--shapes", default=",".join(RUNTIME_SHAPE_CANDIDATES),
                   help="candidates: 'adaptive' (the checkpoint's tau shape under the controller), chain@K, "
                        "tree@K/N (a fixed EAGLE-2 tree of depth K, N nodes with the root); '': keep the stored shape")
    p.add_argument("--draft-temperatures", default="0.7,1.0", metavar="T,T",
                   help="request temperatures to calibrate the draft temperature at ('': skip it)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-lookup", type=int, default=2, metavar="N",
                   help="prompt lookup first on N-token matches, as generate/serve default to (0: off)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    p.add_argument("--dry-run", action="store_true", help="measure and print, do not write the checkpoint")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    import torch

    from specfoundry.runtime.adaptive import check_int, parse_shape_candidate
    from specfoundry.runtime.calibrate import measure_draft_temperature
    from specfoundry.runtime.drafters import load_drafter
    from specfoundry.runtime.cli import DTYPES, check_device
    from specfoundry.runtime.models import load_target
    from specfoundry.runtime.speculators.checkpoint import read_config, set_draft_temperature, set_runtime_shape
    from specfoundry.runtime.tune import chosen_candidate, measure_runtime_shape, shape_label

    from .prompts import load_prompts

    check_int("--limit", args.limit, 1)
    check_int("--max-new-tokens", args.max_new_tokens, 1)
    check_int("--prompt-lookup", args.prompt_lookup, 0, 64)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    temps = [_temperature(t) for t in args.draft_temperatures.split(",") if t.strip()]
    for s in shapes:
        parse_shape_candidate(s)
    if not shapes and not temps:
        raise ValueError("--shapes and --draft-temperatures are both empty: nothing to measure")
    check_device(args.device)
    kind = read_config(args.speculator)["speculator_type"]  # fails before loading anything
    if kind not in ("eagle", "eagle3"):
        raise ValueError(f"{args.speculator}: a {kind!r} speculator; tune-shape measures EAGLE heads (eagle, eagle3)")
    if args.threads:
        check_int("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    prompts = [p.turns[0] for p in load_prompts(args.data)]
    # spread over categories: every k-th prompt rather than the first category's
    step = max(1, len(prompts) // args.limit)
    prompts = prompts[::step][: args.limit]
    target = load_target(args.target, device=args.device, dtype=DTYPES[args.dtype])
    shape = None
    if shapes:
        shape = measure_runtime_shape(target, args.speculator, prompts, shapes, max_new_tokens=args.max_new_tokens,
                                      prompt_lookup=args.prompt_lookup)
        best = chosen_candidate(shape)
        for c, v in shape["speedups"].items():
            print(f"  {c:<10} {v:.2f}x plain decoding{'  <- chosen' if c == best else ''}", file=sys.stderr)
        if not args.dry_run:
            set_runtime_shape(args.speculator, shape)
            print(f"[tune-shape] {args.speculator}: runtime default {shape_label(shape)} (training.runtime_shape)",
                  file=sys.stderr)
    measured = None
    if temps:
        measured = measure_draft_temperature(target, load_drafter(args.speculator, target=target), prompts, temps,
                                             max_new_tokens=args.max_new_tokens)
        by_scale = measured["acceptance"]
        print(f"  draft temperature {measured['scale']:g} x the request's: first-draft acceptance "
              f"{by_scale[format(measured['scale'], 'g')]:.3f} (at 1 x {by_scale.get('1', float('nan')):.3f})", file=sys.stderr)
        if not args.dry_run:
            set_draft_temperature(args.speculator, measured)
            print(f"[tune-shape] {args.speculator}: draft temperature {measured['scale']:g} (training.draft_temperature)",
                  file=sys.stderr)
    print(json.dumps({"runtime_shape": shape, "draft_temperature": measured}, indent=2))
    return 0


def _temperature(text: str) -> float:
    from specfoundry.runtime.adaptive import check_real

    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--draft-temperatures: {text.strip()!r} is not a number") from None
    return check_real("--draft-temperatures", value, 0.0, lo_open=True)
