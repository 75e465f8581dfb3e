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

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # peer_common (no specfoundry)
from peer_common import run_peer, spec_decode_counters, vllm_engine  # noqa: E402


def work(req: dict, result: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result["request"] = {k: v for k, v in req.items() if k != "prompts"}
    llm = vllm_engine(req, result, max_num_seqs=int(req.get("max_num_seqs", 1)))
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


if __name__ == "__main__":
    sys.exit(run_peer(work, sys.argv[1], sys.argv[2], indent=2))
