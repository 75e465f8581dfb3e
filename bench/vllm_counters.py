"""vLLM's speculative-decoding counters, read from ``LLM.get_metrics()``. Runs inside
``.venv-vllm`` (imports no specfoundry): used by ``bench/vllm_peer.py`` and
``tools/vllm_serve.py``, which put this folder on ``sys.path``."""


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
