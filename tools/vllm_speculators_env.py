#!/usr/bin/env python3
"""Bootstrap ``.venv-speculators``: the ``speculators`` package (vLLM's checkpoint format library)
in a virtual environment of its own.

Why separate: speculators 0.9.0 pins ``transformers<=5.19`` (the project uses 5.24) and declares
torchvision/torchaudio, whose PyPI builds pin other torch versions and would replace the CPU
torch 2.13 with a multi-GB CUDA build. So: torch 2.13.0 first, speculators with ``--no-deps``,
then its real runtime dependencies (minus torchvision/torchaudio, which it does not import for
EAGLE-3) under a ``torch==2.13.0`` constraint. pip then prints a "speculators 0.9.0 requires
torchaudio/torchvision, which is not installed" resolver warning: expected, harmless.

Usage (any Python >= 3.10)::

    python tools/vllm_speculators_env.py ensure   # idempotent; prints the venv's python last
    python tools/vllm_speculators_env.py path     # prints it if ready, exit 1 otherwise

Exit codes: 0 ready, 3 PyPI unreachable (callers skip), 1 anything else (a real failure).
Set ``SPECFOUNDRY_SPECULATORS_VENV`` to use another location.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SPECFOUNDRY_SPECULATORS_VENV", ROOT / ".venv-speculators"))
SPECULATORS = "speculators==0.9.0"
TORCH = "torch==2.13.0"
STAMP = VENV / ".specfoundry-speculators-0.9.0"
# speculators 0.9.0's Requires-Dist without torch (pinned first), torchvision and torchaudio
DEPS = [
    "transformers>=5.0,<=5.19.0", "datasets>=4.0.0,<=5.1.0", "aiohttp", "click", "httpx", "huggingface-hub",
    "loguru>=0.7.2,<=0.7.3", "numpy>=2.0.0,<=2.5.4", "openai>=2.0.0", "protobuf", "psutil", "pydantic>=2.0.0",
    "pydantic-settings>=2.0.0", "rich", "safetensors", "tqdm>=4.66.3,<=4.70.1", "typer>=0.12.0",
    "hs-connectors==0.9.0",
]
CHECK = "import speculators.models.eagle3, transformers, torch; print(torch.__version__, transformers.__version__)"


def python() -> Path:
    return VENV / "bin" / "python"


def ready() -> bool:
    if not (STAMP.exists() and python().exists()):
        return False
    return subprocess.run([str(python()), "-c", CHECK], capture_output=True).returncode == 0


def _pip(*args: str) -> None:
    cmd = [str(python()), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def _pypi_reachable() -> bool:
    """Whether the package index answers at all (a failed install is a real failure if it does)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                            SPECULATORS, "-d", tmp], capture_output=True, timeout=600)
    return r.returncode == 0


def ensure() -> int:
    VENV.mkdir(parents=True, exist_ok=True)  # `python -m venv` accepts the existing empty folder
    with open(VENV / ".bootstrap.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes: one bootstrap
        if ready():
            print(python())
            return 0
        try:
            if not python().exists():
                subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
            _pip(TORCH)
            _pip("--no-deps", SPECULATORS)
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c:
                c.write(TORCH + "\n")  # nothing may move torch off the CPU build
            try:
                _pip("-c", c.name, *DEPS)
            finally:
                os.unlink(c.name)
            out = subprocess.run([str(python()), "-c", CHECK], capture_output=True, text=True)
            if out.returncode:
                print(out.stderr, file=sys.stderr)
                return 1
            STAMP.write_text(out.stdout)
        except (subprocess.CalledProcessError, OSError) as exc:
            if not _pypi_reachable():
                print(f"PyPI unreachable: cannot install {SPECULATORS} ({exc})", file=sys.stderr)
                return 3
            print(f"bootstrapping {VENV} failed: {exc}", file=sys.stderr)
            return 1
    print(python())
    return 0


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "ensure"
    if cmd == "ensure":
        return ensure()
    if cmd == "path":
        if ready():
            print(python())
            return 0
        return 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
