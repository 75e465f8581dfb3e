"""Drafters and :func:`load_drafter`, the one way to build one from a name or a checkpoint.

Types are registered by the modules imported below (``register_drafter``); the string is
the one stored in a checkpoint's ``config.json`` (``speculator_type``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..speculators.checkpoint import read_config
from .base import DRAFTER_REGISTRY, DraftContext, Drafter, register_drafter
from . import ngram as _ngram  # noqa: F401  (registers "ngram")
from . import draft as _draft  # noqa: F401  (registers "draft")

from . import eagle as _eagle  # noqa: F401  (registers "eagle", "eagle3")
from . import medusa as _medusa  # noqa: F401  (registers "medusa")
from .lookup import LookupFirstDrafter


def _json_keys(cfg_file: Path) -> set:
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError:
        return {"speculator_type"}  # let read_config report the broken file
    return set(cfg) if isinstance(cfg, dict) else set()


def available_drafters() -> list[str]:
    return sorted(DRAFTER_REGISTRY)


def _build(factory, kind: str, source, target, options: dict) -> Drafter:
    """``factory(source, target, **options)``, an unknown option being a ValueError that names it."""
    try:
        return factory(source, target, **options)
    except TypeError as exc:
        msg = str(exc)
        if "unexpected keyword argument" not in msg:
            raise
        bad = msg.rsplit("argument", 1)[-1].strip()
        raise ValueError(f"unknown option {bad} for the {kind} drafter") from None


def load_drafter(source, target, **options) -> Drafter:
    """Build a drafter for ``target``.

    ``source`` is a registered type (``"ngram"``; ``"eagle3"``/``"eagle"``/``"medusa"`` give a
    random-init head), a speculator checkpoint directory (its ``config.json`` names the type),
    or a local HF model directory / built-in target name used as a ``draft`` model.
    """
    if isinstance(source, str) and source in DRAFTER_REGISTRY:
        return _build(DRAFTER_REGISTRY[source], source, None, target, options)
    path = Path(str(source)).expanduser()
    cfg_file = path / "config.json"
    if path.is_dir() and cfg_file.exists():
        if "speculator_type" in _json_keys(cfg_file):
            # a speculator checkpoint: the one validating reader gives the error messages
            kind = read_config(path)["speculator_type"]
            return _build(DRAFTER_REGISTRY[kind], kind, path, target, options)
        return _build(DRAFTER_REGISTRY["draft"], "draft", path, target, options)
    from ..models import builtin_targets

    if str(source) in builtin_targets():
        return _build(DRAFTER_REGISTRY["draft"], "draft", str(source), target, options)
    raise ValueError(
        f"unknown drafter {source!r}: expected one of {available_drafters()}, a speculator checkpoint "
        "directory, or a local HF draft-model directory"
    )


__all__ = ["DRAFTER_REGISTRY", "DraftContext", "Drafter", "LookupFirstDrafter", "available_drafters", "load_drafter", "register_drafter"]
