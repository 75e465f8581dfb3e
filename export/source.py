"""What an export starts from: a run directory (or a checkpoint) resolved to the target and
the speculator module it holds.

A run directory ``runs/<recipe>/`` holds the trained ``speculator/`` (a speculator checkpoint,
or an HF directory for a distilled draft model). With no run at all, the export uses an
untrained (random-init) EAGLE-3 head for the default target, written once to
``runs/untrained-eagle3-smollm2-135m/`` and labelled as untrained in every report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specfoundry.runtime.models import DEFAULT_TARGET, load_target
from specfoundry.runtime.speculators import SPECULATOR_REGISTRY, load_speculator, read_config, save_speculator
from specfoundry.runtime.target import TargetModel

UNTRAINED_RUN = Path("runs") / f"untrained-eagle3-{DEFAULT_TARGET}"


@dataclass
class ExportSource:
    run_dir: Path
    speculator_dir: Path
    speculator_type: str  # "eagle3", "eagle", "medusa" or "draft"
    target: TargetModel
    module: object  # the head (nn.Module) or, for "draft", the draft LM as a TargetModel
    trained: bool


def _speculator_dir(run: Path) -> Path:
    if (run / "speculator").is_dir():
        return run / "speculator"
    if (run / "config.json").is_file():
        return run
    raise FileNotFoundError(f"{run}: neither a run directory with speculator/ nor a speculator checkpoint")


def _untrained(target_name: str = DEFAULT_TARGET) -> Path:
    spec_dir = UNTRAINED_RUN / "speculator"
    if not (spec_dir / "config.json").exists():
        target = load_target(target_name)
        head = SPECULATOR_REGISTRY["eagle3"].from_target(target)
        save_speculator(head, spec_dir, target, training={"untrained": True})
    return UNTRAINED_RUN


def resolve_source(run: str | Path | None, target: str | None = None) -> ExportSource:
    """Load what ``run`` holds; ``target`` overrides the target name recorded in it."""
    trained = run is not None
    run_dir = Path(run) if run is not None else _untrained()
    spec_dir = _speculator_dir(run_dir)
    cfg = json.loads((spec_dir / "config.json").read_text())
    if isinstance(cfg, dict) and "speculator_type" in cfg:
        cfg = read_config(spec_dir)  # the validating reader
        tgt = load_target(target or cfg["target"]["name"])
        module = load_speculator(spec_dir, tgt)
        kind = cfg["speculator_type"]
        trained = trained and not cfg.get("training", {}).get("untrained", False)
    else:  # an HF draft-model directory
        ident_file = spec_dir / "specfoundry_target.json"
        name = target or (json.loads(ident_file.read_text())["target"]["name"] if ident_file.exists() else DEFAULT_TARGET)
        tgt = load_target(name)
        module = load_target(str(spec_dir))
        kind = "draft"
    check_module_finite(module, spec_dir)
    return ExportSource(run_dir, spec_dir, kind, tgt, module, trained)


def check_module_finite(module, where) -> None:
    """Refuse to export a speculator (head or draft LM) holding NaN/inf weights: every format
    written from it would be unusable. Raises ``ValueError`` naming the tensor."""
    import torch

    net = getattr(module, "model", module) if isinstance(module, TargetModel) else module
    for name, t in net.state_dict().items():
        if torch.is_tensor(t) and t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise ValueError(f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN/inf); refusing to "
                                 "export corrupt or diverged weights")
