"""``specfoundry train <recipe>``: validate, plan (``--dry-run``) or launch through Accelerate."""

from __future__ import annotations

import os
import subprocess
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a speculator from a recipe")
    p.add_argument("recipe", nargs="?", default="eagle3-smollm2-135m", help="recipe name or YAML path")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no download)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field")
    p.add_argument("--list", action="store_true", help="list the shipped recipes")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from .recipe import launch_args, list_recipes, load_recipe, resolve

    if args.list:
        print("\n".join(list_recipes()))
        return 0
    recipe = resolve(load_recipe(args.recipe, overrides=args.set or None))
    if args.dry_run:
        from .plan import format_plan, make_plan

        print(format_plan(make_plan(recipe)))
        return 0
    extra = (["--resume"] if args.resume else []) + [x for kv in args.set for x in ("--set", kv)]
    if (recipe.launcher.num_processes or 1) == 1 and recipe.launcher.deepspeed is None:
        from .run import main  # one process: no launcher needed

        return main([args.recipe, *extra])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args(recipe), "-m",
           "specfoundry.train.run", args.recipe, *extra]
    print("[train] " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd, env=os.environ.copy())
