"""The ``specfoundry`` command line.

``specfoundry generate`` lives here; other subpackages add subcommands through the
``specfoundry.commands`` entry-point group (a callable ``register(subparsers)``), so the
runtime never imports training or export code.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points

import torch

# "auto": the dtype whose plain decoding is fastest on this machine, measured at load (runtime/autodtype.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
          "auto": "auto"}


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative generation with a target and a drafter")
    p.add_argument("--target", default="smollm2-135m", help="built-in target name or local HF directory")
    p.add_argument("--drafter", default="ngram", help="drafter type (ngram, eagle3, ...), checkpoint dir or draft model")
    p.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth", type=int, default=None, help="max draft depth (default: the drafter's)")
    p.add_argument("--nodes", type=int, default=None, help="max draft-tree nodes incl. the root")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="the adaptive draft-shape controller (--no-adaptive: always draft at --depth); default: the "
                        "drafter's (a trained head's measured runtime shape, else on)")
    p.add_argument("--prompt-lookup", type=int, default=2, metavar="N",
                   help="draft the prompt-lookup continuation whenever the last N tokens occurred earlier in "
                        "prompt + output, else the drafter's draft (default 2, measured faster with every "
                        "trained head; 0: off)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA, run the engine's decode and verification steps in CUDA graphs (default: on "
                        "for engine targets on CUDA; --no-cuda-graphs: eager)")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="auto (default): the dtype whose plain decoding is fastest here, measured at load")
    p.add_argument("--backend", default="auto", choices=["auto", "engine", "hf"],
                   help="decoding path: the static-cache engine (auto: where the architecture allows) or HF's")
    p.add_argument("--compare", action="store_true", help="also run plain decoding and compare")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_generate)


def _fmt_stats(name: str, s) -> str:
    acc = " ".join(f"{a:.2f}" for a in s.acceptance_by_position) or "-"
    return (f"{name:>12}: {s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_second:.1f} tok/s), "
            f"tau {s.tau:.2f}, target forwards {s.target_forwards}, drafted {s.drafted}, accepted {s.accepted}, "
            f"acceptance by position [{acc}]")


def check_device(device: str) -> None:
    """One sentence for a device this machine does not have (instead of a torch traceback later)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device {device!r} is not a device name (cpu, cuda, cuda:N, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available here (no GPU, or torch built without CUDA); "
                             "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device}: unsupported device type {dev.type!r} (cpu, cuda, mps)")


def check_generate_args(args) -> None:
    """Validate ``generate``'s flags before anything is loaded: one sentence per bad value."""
    from .adaptive import MAX_DRAFT_DEPTH, MAX_DRAFT_NODES, check_int
    from .sampling import SamplingParams

    check_int("--max-new-tokens", args.max_new_tokens, 1)
    SamplingParams(args.temperature, args.top_k, args.top_p)
    check_int("--seed", args.seed, 0, 2**64 - 1)
    if args.depth is not None:
        check_int("--depth", args.depth, 1, MAX_DRAFT_DEPTH)
    if args.nodes is not None:
        check_int("--nodes", args.nodes, 2, MAX_DRAFT_NODES)
    check_int("--prompt-lookup", args.prompt_lookup, 0, 64)
    check_device(args.device)


def _generate(args) -> int:
    from .generator import SpeculativeGenerator
    from .drafters import load_drafter
    from .drafters.lookup import with_lookup
    from .lossless import compare_greedy
    from .models import load_target

    check_generate_args(args)
    target = load_target(args.target, device=args.device, dtype=DTYPES[args.dtype], backend=args.backend)
    drafter = load_drafter(args.drafter, target=target)
    drafter = with_lookup(drafter, args.prompt_lookup)
    gen = SpeculativeGenerator(target, drafter, max_depth=args.depth, max_nodes=args.nodes, adaptive=args.adaptive,
                               cuda_graphs=args.cuda_graphs)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.json:
        out = gen.generate(messages, **kw)
    else:
        ids, stats = [], None
        for chunk in gen.stream(messages, **kw):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            ids.extend(chunk.token_ids)
            stats = chunk.stats
        sys.stdout.write("\n")
        from .generator import GenerationOutput

        out = GenerationOutput(ids, target.decode(ids), stats, target.encode_chat(messages))
    result = {"target": target.name, "drafter": args.drafter, "text": out.text, "token_ids": out.token_ids,
              "stats": out.stats.as_dict()}
    code = 0
    if args.compare:
        plain = gen.generate(messages, speculate=False, **kw)
        result["plain_stats"] = plain.stats.as_dict()
        result["wall_clock_ratio"] = plain.stats.seconds / out.stats.seconds if out.stats.seconds else None
        if args.temperature == 0:
            cmp = compare_greedy(target, out.prompt_ids, out.token_ids, plain.token_ids)
            result["identical"] = cmp.identical
            result["comparison"] = cmp.as_dict()
            code = 0 if cmp.ok else 1
    if args.json:
        print(json.dumps(result, indent=2))
        return code
    print(_fmt_stats("speculative", out.stats), file=sys.stderr)
    if args.compare:
        print(_fmt_stats("plain", plain.stats), file=sys.stderr)
        if "identical" in result:
            cmp = result["comparison"]
            verdict = "identical to plain greedy" if cmp["identical"] else (
                f"differs at token {cmp['first_divergence']} (top-2 gap {cmp['top2_gap']:.2e}: "
                + ("a rounding near-tie)" if cmp["near_tie"] else "NOT a near-tie: lossless violation)"))
            print(f"      output: {verdict}", file=sys.stderr)
        print(f" speed-up: {result['wall_clock_ratio']:.2f}x wall clock vs plain decoding (tau {out.stats.tau:.2f})",
              file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfoundry", description="Train, export and serve lossless speculators.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for ep in entry_points(group="specfoundry.commands"):
        ep.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specfoundry: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
