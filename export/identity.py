"""Which target an exported artifact belongs to: ``specfoundry_target.json`` in every artifact
directory.

Scope: writing the record (:func:`write_identity`), reading it (:func:`read_identity`) and
refusing an artifact for another target (:func:`check_artifact`). Serving engines never read
this file; it is for our own readers and for people deploying an artifact, so that a head
trained for one target is not silently served beside another (it would load, run and accept
almost nothing).

``specfoundry_target.json``::

    {
      "format": "specfoundry.artifact", "format_version": 1,
      "artifact_format": "vllm",            # the serving format / artifact kind written
      "speculator_type": "eagle3",          # eagle3 | eagle | medusa | draft
      "target": {"name": str, "vocab_size": int, "hidden_size": int, "num_layers": int,
                 "fingerprint": str}        # TargetModel.identity()
    }

A target matches when vocabulary size, hidden size, layer count and embedding fingerprint all
agree (the name is informational: the same model may be loaded under another path).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "IDENTITY_KEYS",
    "IDENTITY_NAME",
    "ArtifactError",
    "ArtifactMismatchError",
    "check_artifact",
    "read_identity",
    "write_identity",
]

IDENTITY_NAME = "specfoundry_target.json"
FORMAT = "specfoundry.artifact"
FORMAT_VERSION = 1
# what must agree between the recorded target and the given one
IDENTITY_KEYS = ("vocab_size", "hidden_size", "num_layers", "fingerprint")


class ArtifactError(ValueError):
    """An artifact directory whose identity record is missing or unreadable."""


class ArtifactMismatchError(ArtifactError):
    """The artifact was exported for a different target than the one given."""

    def __init__(self, path, recorded: dict, given: dict, differ: list[str], speculator_type: str | None = None):
        self.path = str(path)
        self.recorded = recorded
        self.given = given
        self.differ = differ
        what = f"this {speculator_type} artifact" if speculator_type else "this artifact"
        super().__init__(
            f"{self.path}: {what} was trained for target {_describe(recorded)} but the given target is "
            f"{_describe(given)}; they differ in {', '.join(differ)}"
        )


def _describe(identity: dict) -> str:
    return (f"{identity.get('name')!r} (vocab_size={identity.get('vocab_size')}, hidden_size={identity.get('hidden_size')}, "
            f"num_layers={identity.get('num_layers')}, fingerprint={identity.get('fingerprint')})")


def _identity_of(target) -> dict:
    ident = target.identity() if hasattr(target, "identity") else dict(target)
    return {k: ident[k] for k in ("name", *IDENTITY_KEYS)}


def write_identity(directory, target, speculator_type: str, fmt: str) -> Path:
    """Write ``<directory>/specfoundry_target.json`` for ``target`` (a ``TargetModel`` or its
    ``identity()`` dict); returns the file's path."""
    path = Path(directory) / IDENTITY_NAME
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "artifact_format": str(fmt),
        "speculator_type": str(speculator_type),
        "target": _identity_of(target),
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def read_json(path, missing: str = "missing") -> dict:
    """A JSON object from ``path``; :class:`ArtifactError` when missing, unreadable or not an object."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: {missing}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return obj


def read_identity(directory) -> dict:
    """The parsed record of an artifact directory; :class:`ArtifactError` when missing or malformed."""
    path = Path(directory) / IDENTITY_NAME
    record = read_json(path, missing="missing; not an artifact exported by specfoundry (cannot tell which target it is for)")
    # train/ writes a bare {"target", "speculator_type"} beside draft models (it may not import
    # export/): accept it; anything claiming another format is refused
    if record.get("format", FORMAT) != FORMAT:
        raise ArtifactError(f"{path}: expected format {FORMAT!r}, got {record.get('format')!r}")
    if record.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise ArtifactError(f"{path}: this version reads format_version {FORMAT_VERSION}, got {record.get('format_version')!r}")
    target = record.get("target")
    if not isinstance(target, dict) or any(k not in target for k in IDENTITY_KEYS):
        raise ArtifactError(f"{path}: 'target' must hold {', '.join(IDENTITY_KEYS)}")
    return record


def check_artifact(directory, target) -> dict:
    """Refuse an artifact exported for another target; returns the record when it matches.

    Raises :class:`ArtifactMismatchError` naming both targets and the fields that differ.
    """
    record = read_identity(directory)
    given = _identity_of(target)
    recorded = record["target"]
    differ = [k for k in IDENTITY_KEYS if recorded[k] != given[k]]
    if differ:
        raise ArtifactMismatchError(directory, recorded, given, differ, record.get("speculator_type"))
    return record
