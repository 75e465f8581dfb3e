"""Shared by the out-of-process peers (``bench/vllm_peer.py``, ``bench/llamacpp_peer.py``). They
run in their own virtualenvs and import no specfoundry: each puts this folder on ``sys.path``.
vLLM is imported only inside the functions that need it."""

import json
import os
import time
import traceback


def run_peer(work, request_path: str, result_path: str, indent=None) -> int:
    """Read the JSON request, run ``work(request, result)`` (it fills ``result``), write the
    result JSON; any failure is reported in it as ``error`` + ``traceback`` and exits 1."""
    req = json.loads(open(request_path).read())
    result: dict = {}
    code = 0
    try:
        work(req, result)
    except BaseException as exc:  # the caller reports it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
        code = 1
    open(result_path, "w").write(json.dumps(result, indent=indent))
    return code


def vllm_engine(req: dict, result: dict, max_num_seqs: int = 1):
    """vLLM's offline ``LLM`` for a request (``model``, ``dtype``, ``max_model_len``, optional
    ``speculator``/``method``/``k``/``draft_sample_method``, ``fix_expand``), eager mode, the
    engine core in this process; records ``startup_seconds`` and, after startup, ``expand_check``:
    :func:`vllm_t1_repro.check_expand` on the engine's own ``expand_batch_to_tokens`` (its T>0
    per-token temperatures; ``docs/vllm-cpu-t1-bug.md``), with ``fix_applied`` when
    ``fix_expand`` installed :func:`vllm_t1_repro.install_fix` first."""
    # in-process engine core: the fix and the check below then act on the engine's own kernels
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_t1_repro import check_expand, install_fix  # beside this file, on sys.path

    kwargs = dict(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "float32"), enforce_eager=True,
                  max_model_len=int(req.get("max_model_len", 1024)), seed=0, disable_log_stats=False,
                  max_num_seqs=int(max_num_seqs))
    if req.get("speculator") or req.get("method"):
        spec = {"method": req.get("method", "eagle3"), "num_speculative_tokens": int(req["k"])}
        if req.get("speculator"):
            spec["model"] = req["speculator"]
        if req.get("draft_sample_method"):
            spec["draft_sample_method"] = req["draft_sample_method"]
        spec.update(req.get("speculative_extra") or {})
        kwargs["speculative_config"] = spec
    result["fix_applied"] = install_fix() if req.get("fix_expand") else None
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result["startup_seconds"] = time.perf_counter() - t0
    import torch
    from vllm.v1.sample import rejection_sampler

    result["expand_check"] = check_expand(rejection_sampler.expand_batch_to_tokens, torch)
    return llm


def spec_decode_counters(llm) -> dict:
    """``{"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"}``,
    aggregated over the engine's life so far (take differences around a call for one call)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts" and isinstance(m, Counter):
            out["num_drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens" and isinstance(m, Counter):
            out["num_draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens" and isinstance(m, Counter):
            out["num_accepted_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(m, Vector):
            vals = list(m.values)
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    return out
