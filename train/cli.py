"""``specfoundry train <recipe>``: validate, plan (``--dry-run``) or launch through Accelerate."""

from __future__ import annotations

import os
import subprocess
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a speculator from a recipe")
    p.add_argument("recipe", nargs="?", default=None,
                   help="recipe name or YAML path (required; `--list` shows the shipped ones)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no download)")
    p.add_argument("--resume", action="store_true", help="continue the run from its newest valid checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="clear the run directory of an earlier run and start a new one")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field")
    p.add_argument("--list", action="store_true", help="list the shipped recipes")
    p.add_argument("--smoke", action="store_true",
                   help="run the recipe's code path end to end on CPU at toy scale (tiny random target of the same "
                        "family, 2 gloo processes, a few steps, then export); see specfoundry.train.smoke")
    p.set_defaults(func=run_train, usage=p.format_usage)


def run_train(args) -> int:
    from .recipe import launch_args, list_recipes, load_recipe, resolve

    if args.list:
        print("\n".join(list_recipes()))
        return 0
    if args.recipe is None:
        # no silent default: training writes runs/<recipe>/ and takes minutes to hours
        usage = args.usage() if hasattr(args, "usage") else "usage: specfoundry train RECIPE\n"
        print(usage + "specfoundry train: error: name a recipe (shipped: " + ", ".join(list_recipes())
              + "), e.g. `specfoundry train eagle3-smollm2-135m`", file=sys.stderr)
        return 2
    if getattr(args, "smoke", False):
        from .smoke import smoke_overrides

        args.set = smoke_overrides(args.recipe) + list(args.set)  # the user's --set still win
    recipe = resolve(load_recipe(args.recipe, overrides=args.set or None))
    from .preflight import format_checks, preflight, report_failures

    if args.dry_run:
        from .plan import format_plan, make_plan

        plan = make_plan(recipe)
        print(format_plan(plan))
        print(format_checks(preflight(recipe, plan=plan)))
        return 0
    checks = preflight(recipe, allow_download=True)  # before anything is spawned: one line per problem
    if any(c.status == "fail" for c in checks):
        report_failures(checks, recipe.name)
        return 2
    if getattr(args, "smoke", False):
        from .smoke import run_smoke

        return run_smoke(args, recipe)
    extra = (["--resume"] if args.resume else []) + (["--overwrite"] if args.overwrite else []) \
        + [x for kv in args.set for x in ("--set", kv)]
    if (recipe.launcher.num_processes or 1) == 1 and recipe.launcher.deepspeed is None:
        from .run import main  # one process: no launcher needed

        rc = main([args.recipe, *extra])
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args(recipe), "-m",
               "specfoundry.train.run", args.recipe, *extra]
        print("[train] " + " ".join(cmd), file=sys.stderr)
        rc = subprocess.call(cmd, env=os.environ.copy())
    if rc == 0:
        print(final_line(recipe.output_dir), flush=True)
    return rc


def final_line(run_dir) -> str:
    """The line a finished run ends with: which stages a minute guard stopped (planned vs done),
    or that all ran as planned; read from the run's ``train_summary.json``."""
    import json
    from pathlib import Path

    from .stages import guard_line

    try:
        summary = json.loads((Path(run_dir) / "train_summary.json").read_text())
    except (OSError, ValueError):
        return f"[train] WARNING: no readable train_summary.json in {run_dir}: planned vs done unknown"
    return guard_line(summary.get("stages"))
