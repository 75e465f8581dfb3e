"""llama.cpp peer for ``specfoundry bench`` (runs in whichever venv imports ``llama_cpp``).

    python llamacpp_peer.py <request.json> <result.json>

request: ``{"model": gguf, "prompts": [[ids]], "max_tokens", "temperature", "seeds", "ignore_eos"}`` and,
for llama-cpp-python's prompt lookup decoding, ``"lookup": K`` (draft tokens) and ``"max_ngram"``;
result: ``{"results": [{"token_ids", "seconds", "stats": null}]}`` or ``{"error"}``. ``"threads"``
(default 1): llama.cpp's decode and prompt threads, the bench's own thread count; batch 1, prompts given
as token ids (same vocabulary as the target's tokenizer).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_common, beside this file
from peer_common import run_peer  # noqa: E402


def work(req: dict, result: dict) -> None:
    import inspect

    import llama_cpp

    threads = int(req.get("threads", 1))
    kwargs = dict(model_path=req["model"], n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    if "use_extra_bufts" in inspect.signature(llama_cpp.Llama.__init__).parameters:
        # the extra (AMX) buffer types hit an illegal instruction on an AMX Xeon (`make llamacpp-peer`
        # also builds without the AMX kernels, which crashed there even with these off)
        kwargs["use_extra_bufts"] = False
    if req.get("lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=int(req["lookup"]),
                                                          max_ngram_size=int(req.get("max_ngram", 3)))
        # with a draft model llama-cpp-python keeps logits for every position but sizes its score
        # buffer from the logits_all argument (n_batch = 512 rows when False): a prompt plus output
        # past 512 tokens then fails with "could not broadcast ... into shape (0,)"
        kwargs["logits_all"] = True
    llm = llama_cpp.Llama(**kwargs)
    result["version"] = llama_cpp.__version__
    T = float(req["temperature"])
    eos = llm.token_eos()
    rows = []
    for ids, seed in zip(req["prompts"], req["seeds"]):
        llm.reset()
        llm.set_seed(int(seed))
        toks = []
        t0 = time.perf_counter()
        for tok in llm.generate(list(ids), temp=T, top_k=0 if T > 0 else 1, top_p=1.0, reset=True):
            if tok == eos and not req["ignore_eos"]:
                toks.append(tok)
                break
            toks.append(tok)
            if len(toks) >= int(req["max_tokens"]):
                break
        rows.append({"token_ids": toks, "seconds": time.perf_counter() - t0, "stats": None})
    result["results"] = rows


if __name__ == "__main__":
    sys.exit(run_peer(work, sys.argv[1], sys.argv[2]))
