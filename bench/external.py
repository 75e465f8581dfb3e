"""Out-of-process peers, each in its own virtualenv (never a dependency of specfoundry):

- ``vllm`` / ``vllm-eagle3[@K]``: vLLM on CPU from ``.venv-vllm`` (``make check-vllm`` builds it),
  plain and with our EAGLE-3 head exported to the speculators format; one engine per
  subprocess (:mod:`specfoundry.bench.vllm_peer`), prompts run one at a time and timed each.
- ``llamacpp`` / ``llamacpp-lookup[@K]``: ``llama-cpp-python`` if importable in one of the project's
  virtualenvs (``make llamacpp-peer`` builds ``.venv-llamacpp``), on the built-in target's GGUF (Q4_1
  weights, so plain llama.cpp is compared with our output for information only), plain and with its
  prompt lookup decoding; the lookup output is compared token for token with llama.cpp's own plain
  output, and the report shows where they differ.

These cannot be interleaved with our methods (an engine takes minutes to start), so they run
after the interleaved loop on the same prompt ids; the report marks them ``interleaved: false``.
:func:`availability` says why a peer is not installed instead of failing.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from .methods import Method, RunResult
from .report import VLLM_T1_DOC, VLLM_T1_OK

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT = int(os.environ.get("SPECFOUNDRY_BENCH_ENGINE_TIMEOUT", "3600"))


def project_root() -> Path:
    """The checkout root (``bench/..``) in an editable install; the current directory otherwise."""
    root = HERE.parent
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def venv_pythons() -> list[Path]:
    root = project_root()
    return [p for p in (root / v / "bin" / "python" for v in (".venv", ".venv-vllm", ".venv-speculators", ".venv-llamacpp")) if p.exists()]


def _imports(python: Path, module: str) -> bool:
    r = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    return r.returncode == 0


def vllm_python() -> Path:
    return Path(os.environ.get("SPECFOUNDRY_VLLM_VENV", project_root() / ".venv-vllm")) / "bin" / "python"


def availability(name: str, target_source: str, eagle3_run: bool, dtype: str = "float32") -> tuple[bool, str]:
    """(available, reason) of an external peer."""
    if name in ("vllm", "vllm-eagle3"):
        if dtype not in ("float32", "bfloat16", "float16"):
            return False, f"vLLM does not serve {dtype} (run the bench with --dtype float32 or bfloat16)"
        py = vllm_python()
        if not py.exists():
            return False, f"not installed: {py.parent.parent} does not exist (`make check-vllm` builds it)"
        if not _imports(py, "vllm"):
            return False, f"not installed: `import vllm` fails in {py.parent.parent}"
        if name == "vllm-eagle3" and not eagle3_run:
            return False, "needs a trained eagle3 run (--run runs/<recipe>): an untrained head is never accepted"
        return True, "ok"
    if name in ("llamacpp", "llamacpp-lookup"):
        found = [p for p in venv_pythons() if _imports(p, "llama_cpp")]
        if not found:
            tried = ", ".join(str(p.parent.parent.name) for p in venv_pythons()) or "none found"
            return False, (f"not installed: llama_cpp (llama-cpp-python) is not importable in any project venv "
                           f"({tried}); it needs a local C++ build, which the benchmark does not attempt")
        if gguf_path(target_source) is None:
            return False, "needs a GGUF of the target (only the built-in smollm2-135m ships one)"
        return True, str(found[0])
    raise ValueError(f"unknown external peer {name!r}")


def gguf_path(target_source: str) -> Path | None:
    import importlib.util

    from specfoundry.runtime.models import _BUILTIN

    spec = _BUILTIN.get(target_source)
    found = importlib.util.find_spec(spec["package"]) if spec else None
    if found is None:
        return None
    p = Path(found.submodule_search_locations[0]) / spec["gguf"]
    return p if p.exists() else None


def _run_engine(python: Path, script: Path, request: dict, work: Path, name: str, timeout: int | None = None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    req, res, log = work / f"{name}.request.json", work / f"{name}.result.json", work / f"{name}.log"
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with open(log, "w") as logf:
        try:
            rc = subprocess.run([str(python), str(script), str(req), str(res)], stdout=logf, stderr=subprocess.STDOUT,
                                env=env, timeout=timeout or ENGINE_TIMEOUT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = json.loads(res.read_text()) if res.exists() else {}
    if rc != 0 and "error" not in out:
        out["error"] = f"engine exited with {rc}; see {log}"
    return out


def external_method(name: str, depth: int | None, target, target_source: str, work: Path,
                    eagle3_source=None) -> Method:
    """A non-interleaved :class:`Method` whose ``batch_runner(prompts, max_new_tokens,
    temperature, seeds, stop_at_eos)`` returns one :class:`RunResult` per prompt."""
    from specfoundry.runtime.models import resolve_target_path

    dtype = str(target.dtype).replace("torch.", "")
    if name in ("llamacpp", "llamacpp-lookup"):
        import torch

        python = Path(availability(name, target_source, False)[1])
        # the same thread count as our methods (llama.cpp takes its own, not OMP_NUM_THREADS)
        threads = torch.get_num_threads()
        label = f"llama.cpp (llama-cpp-python), the GGUF's Q4_1 weights, {threads} thread{'s' * (threads > 1)}"
        request_base = {"model": str(gguf_path(target_source)), "threads": threads}
        script = HERE / "llamacpp_peer.py"
        if name == "llamacpp-lookup":
            depth = depth or 5  # as hf-lookup: K drafted tokens, n-grams up to 3
            request_base.update(lookup=depth, max_ngram=3)
            label += f", prompt lookup decoding (LlamaPromptLookupDecoding, {depth} tokens, max n-gram 3)"
    else:
        python, script = vllm_python(), HERE / "vllm_peer.py"
        model_dir = str(resolve_target_path(target_source)[0])
        request_base = {"model": model_dir, "dtype": dtype}
        label = "vLLM (CPU, .venv-vllm), plain"
        if name == "vllm-eagle3":
            from specfoundry.export.serving import export_vllm
            from specfoundry.runtime.speculators import load_speculator

            depth = depth or 3
            head = load_speculator(eagle3_source.path, target)
            export_dir = work / "vllm_eagle3_export"
            entry = export_vllm(head, target, export_dir, num_speculative_tokens=depth, verifier=model_dir)
            if entry.get("status") != "written":
                raise RuntimeError(f"export of the eagle3 head for vLLM failed: {entry.get('reason')}")
            request_base.update(speculator=str(export_dir), method="eagle3", k=depth)
            label = f"vLLM (CPU) + our EAGLE-3 head ({eagle3_source.run}), chain k={depth}"

    def batch(prompts, max_new_tokens, temperature, seeds, stop_at_eos) -> list[RunResult]:
        req = {**request_base, "prompts": [list(p) for p in prompts], "max_tokens": max_new_tokens,
               "temperature": temperature, "seeds": list(seeds), "ignore_eos": not stop_at_eos,
               "max_model_len": max(len(p) for p in prompts) + max_new_tokens + 16}
        out = _run_engine(python, script, req, work, f"{name}-T{temperature:g}")
        if "error" in out:
            raise RuntimeError(f"{name}: {out['error']}")
        ec = out.get("expand_check")
        if name == "vllm-eagle3" and temperature > 0 and ec is not None:
            # the engine's own check of the T>0 bug (docs/vllm-cpu-t1-bug.md); report.py marks the
            # rows as not target samples unless it passed
            method.note += (f"; T={temperature:g}: {VLLM_T1_OK} in the engine" if ec["ok"] else
                            f"; T={temperature:g}: the engine's expand_batch_to_tokens returned "
                            f"{[float(f'{v:.2g}') for v in ec['observed'][:3]]}... "
                            f"for temperatures {ec['input']['x']} (vLLM CPU bug, {VLLM_T1_DOC})")
        return [RunResult(r["token_ids"], r["seconds"], r.get("stats")) for r in out["results"]]

    if name == "vllm-eagle3":
        check, reference, note = "strict", "vllm", "lossless check against vLLM's own plain greedy output"
    elif name == "llamacpp-lookup":
        # llama.cpp's own losslessness: exact equality with its plain output (our target's logits
        # cannot judge near-ties of Q4_1 weights), shown as "differs", not as our failure
        check, reference, note = "exact", "llamacpp", "compared token for token with llama.cpp's own plain output"
    else:
        check, reference = ("exact" if name == "llamacpp" else "info"), "plain"
        note = "other kernels/weights: identical-output rate vs our greedy is informational"
    suffix = f"@{depth}" if name in ("vllm-eagle3", "llamacpp-lookup") else ""
    method = Method(name + suffix, label, "peer", None, draft_depth=depth, interleaved=False, check=check,
                    reference=reference, note="separate engine process, not interleaved; " + note, batch_runner=batch)
    return method

