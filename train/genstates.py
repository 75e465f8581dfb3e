"""Target states that self-distillation's own forwards computed: one file per answered prompt.

Scope: batched generation on the engine can hand back the target's states at the feature layers
for every position of prompt + answer (:func:`specfoundry.train.generation.generate_batched`,
``state_layers``); :func:`write_states` stores one prompt's as ``<root>/<hash of the prompt>.safetensors``
(its token ids and ``[n, F, H]`` states), and :class:`GenerationStates` reads an example's back for
the offline hidden-state store (:meth:`specfoundry.train.features.HiddenStateSource.prepare`), which then
runs no capture forward for it. Measured reason (docs/results.md, forty-fifth session): on a 2-core
Xeon without AMX the default recipe's capture pass took ~2.5 of its 20 minutes, recomputing states the
generation had already computed.

A file is used only when it holds exactly the example's tokens (a prefix, for an example truncated to
``max_seq_len``) and the layers asked for; anything else (no file, other tokens, other layers, a
damaged file) reads as None and the store captures that example as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from specfoundry.runtime.atomic import atomic_file

from .datacache import stable_hash

__all__ = ["write_states", "GenerationStates", "state_layers_for"]


def state_layers_for(feature_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The hidden-state indices generation keeps: the feature layers and ``num_layers`` (the final
    normed state, whose LM head gives the distillation labels), sorted, once each."""
    return tuple(sorted({int(i) for i in feature_layers} | {int(num_layers)}))


def _path(root: Path, prompt: str) -> Path:
    return Path(root) / f"{stable_hash('prompt-states', prompt)[:32]}.safetensors"


def write_states(root: str | Path, prompt: str, ids: Sequence[int], states: torch.Tensor,
                 layers: Sequence[int]) -> None:
    """Store ``prompt``'s ``states`` ``[len(ids), F, H]`` (hidden-state indices ``layers``) beside its
    token ids; atomic, so a killed run leaves a whole file or none."""
    from safetensors.torch import save_file

    ids_t = torch.as_tensor(list(ids), dtype=torch.int64)
    if states.dim() != 3 or states.shape[0] != ids_t.numel() or states.shape[1] != len(layers):
        raise ValueError(f"states {tuple(states.shape)} do not match {ids_t.numel()} tokens x {len(layers)} layers")
    with atomic_file(_path(Path(root), prompt)) as tmp:
        save_file({"ids": ids_t, "states": states.contiguous()}, str(tmp),
                  metadata={"layers": json.dumps([int(i) for i in layers])})


class GenerationStates:
    """``GenerationStates(root, feature_layers, num_layers)``: ``get(prompt, input_ids)`` ->
    ``(features [n, F, H], last_hidden [n, H])`` of an example from the file generation wrote for its
    prompt, or None (see the module docstring); ``found`` counts the examples served."""

    def __init__(self, root: str | Path, feature_layers: Sequence[int], num_layers: int):
        self.root = Path(root)
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.num_layers = int(num_layers)
        self.found = 0

    def get(self, prompt: str, input_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        from safetensors import safe_open

        path = _path(self.root, prompt)
        if not path.exists():
            return None
        n = len(input_ids)
        try:
            with safe_open(str(path), framework="pt") as f:
                layers = json.loads((f.metadata() or {}).get("layers", "[]"))
                ids = f.get_tensor("ids")
                if ids.numel() < n or not torch.equal(ids[:n], torch.as_tensor(list(input_ids), dtype=torch.int64)):
                    return None
                want = self.feature_layers + (self.num_layers,)
                if any(i not in layers for i in want):
                    return None
                states = f.get_slice("states")[:n]
        except Exception:  # noqa: BLE001 - truncated or foreign: the store captures this example instead
            return None
        pick = [layers.index(i) for i in self.feature_layers]
        self.found += 1
        return states[:, pick], states[:, layers.index(self.num_layers)]
