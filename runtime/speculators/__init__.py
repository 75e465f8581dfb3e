"""Speculator model definitions (the trainable heads) and their checkpoint format.

Scope: ``nn.Module`` classes the runtime drafts with and training imports from here: EAGLE-1
(:class:`~.eagle.EagleHead`), EAGLE-3 (:class:`~.eagle.Eagle3Head`) and Medusa
(:class:`~.medusa.MedusaHeads`), plus :func:`~.checkpoint.save_speculator` /
:func:`~.checkpoint.load_speculator`. Drafting logic (trees, KV bookkeeping) lives in
``runtime/drafters``; draft *models* are plain HF directories, not speculators.

:data:`SPECULATOR_REGISTRY` (:mod:`.registry`) maps the ``speculator_type`` string stored in a
checkpoint's ``config.json`` to its module class; every class provides ``type``,
``ARCHITECTURE_SCHEMA``, ``architecture`` (dict), ``architecture_problems(arch, target)``,
``build(arch, target)``, ``from_target(target, seed=0, **architecture)`` and ``feature_layers``.
"""

from __future__ import annotations

from .checkpoint import CheckpointError, TargetMismatchError, load_speculator, read_config, save_speculator
from .eagle import Eagle3Head, EagleHead
from .medusa import MedusaHeads, default_medusa_choices, fit_medusa_choices, tree_accepted
from .registry import SPECULATOR_REGISTRY

__all__ = [
    "SPECULATOR_REGISTRY",
    "CheckpointError",
    "Eagle3Head",
    "EagleHead",
    "MedusaHeads",
    "TargetMismatchError",
    "default_medusa_choices",
    "fit_medusa_choices",
    "load_speculator",
    "read_config",
    "save_speculator",
    "tree_accepted",
]
