#!/usr/bin/env python3
"""Serve a target (optionally with a speculator) through vLLM's offline ``LLM`` API and report
greedy outputs and spec-decode metrics. Runs inside ``.venv-vllm`` (``tools/check_vllm.py``
builds it and calls this in a subprocess, one engine per process); imports no specfoundry.

    python tools/vllm_serve.py <request.json> <result.json>

request: ``{"model": dir, "speculator": dir | null, "method": "eagle3", "k": int,
"prompts": [[token ids], ...], "max_tokens": int, "dtype": "float32", "max_model_len": int}``.

result: ``{"outputs": [[token ids], ...], "metrics": {"num_drafts", "num_draft_tokens",
"num_accepted_tokens", "accepted_per_pos"}, "mean_acceptance_length", "seconds",
"startup_seconds"}``; on failure ``{"error": "<type>: <message>", "traceback": ...}`` and exit 1.
"""

import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # vllm_counters (no specfoundry)
from vllm_counters import spec_decode_counters  # noqa: E402


def main(request_path: str, result_path: str) -> int:
    req = json.loads(open(request_path).read())
    result: dict = {"request": {k: v for k, v in req.items() if k != "prompts"}}
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kwargs = dict(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "float32"),
                      enforce_eager=True, max_model_len=int(req.get("max_model_len", 1024)), seed=0,
                      disable_log_stats=False, max_num_seqs=int(req.get("max_num_seqs", 1)))
        if req.get("speculator"):
            kwargs["speculative_config"] = {"method": req.get("method", "eagle3"), "model": req["speculator"],
                                            "num_speculative_tokens": int(req["k"])}
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["startup_seconds"] = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["seconds"] = time.perf_counter() - t0
        result["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        m = spec_decode_counters(llm)
        result["metrics"] = m
        # vLLM's own definition (examples/offline_inference/spec_decode.py): 1 + accepted / drafts
        result["mean_acceptance_length"] = (1 + m["num_accepted_tokens"] / m["num_drafts"]) if m["num_drafts"] else None
    except BaseException as exc:  # report every failure, the caller prints it
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
        open(result_path, "w").write(json.dumps(result, indent=2))
        return 1
    open(result_path, "w").write(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
