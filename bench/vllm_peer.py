"""vLLM peer for ``specfoundry bench`` (runs inside ``.venv-vllm``; imports no specfoundry).

    python vllm_peer.py <request.json> <result.json>

request: ``{"model", "dtype", "prompts": [[ids]], "max_tokens", "temperature", "seeds", "ignore_eos",
"max_model_len", optional "speculator", "method", "k", "draft_sample_method", "speculative_extra",
"fix_expand"}`` (see :func:`peer_common.vllm_engine`). One warm-up generation, then each prompt
alone (batch 1), timed; per-prompt spec-decode counters from vLLM's metrics. result:
``{"results": [{"token_ids", "seconds", "stats"}], "startup_seconds", "version", "expand_check",
"fix_applied"}`` or ``{"error"}``. ``expand_check.ok`` false: at T>0 this engine divided the target
logits by garbage (``docs/vllm-cpu-t1-bug.md``), so its speculative outputs are not target samples.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_common, beside this file
from peer_common import run_peer, spec_decode_counters, vllm_engine  # noqa: E402


def work(req: dict, result: dict) -> None:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    result["version"] = vllm.__version__
    llm = vllm_engine(req, result)
    T = float(req["temperature"])

    def params(seed):
        return SamplingParams(temperature=T, top_k=-1 if T > 0 else 1, top_p=1.0, seed=seed,
                              max_tokens=int(req["max_tokens"]), ignore_eos=bool(req["ignore_eos"]))

    llm.generate([TokensPrompt(prompt_token_ids=list(req["prompts"][0]))], params(0), use_tqdm=False)  # warm-up
    rows = []
    for ids, seed in zip(req["prompts"], req["seeds"]):
        before = spec_decode_counters(llm) if (req.get("speculator") or req.get("method")) else None
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params(int(seed)), use_tqdm=False)
        seconds = time.perf_counter() - t0
        toks = list(out[0].outputs[0].token_ids)
        stats = None
        if before is not None:
            after = spec_decode_counters(llm)
            drafts = after["num_drafts"] - before["num_drafts"]
            prev = before["accepted_per_pos"]
            per_pos = [a - (prev[i] if i < len(prev) else 0) for i, a in enumerate(after["accepted_per_pos"])]
            # per position d: tried = accepted at d-1 (drafts for d = 1), passed = accepted at d
            tried = [drafts] + per_pos[:-1]
            stats = {"drafted": after["num_draft_tokens"] - before["num_draft_tokens"],
                     "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"],
                     "target_forwards": drafts, "tried": tried, "passed": per_pos,
                     "tau": len(toks) / drafts if drafts else None}
        rows.append({"token_ids": toks, "seconds": seconds, "stats": stats})
    result["results"] = rows


if __name__ == "__main__":
    sys.exit(run_peer(work, sys.argv[1], sys.argv[2]))
