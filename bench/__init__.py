"""``specfoundry bench``: interleaved wall-clock benchmarks of our decoding methods and peers.

    specfoundry bench --run runs/<recipe> --data ../shared/data/eval/spec_bench/question.jsonl --limit 10

Modules: :mod:`.prompts` (prompt sets), :mod:`.methods` (our methods, HF peers),
:mod:`.external` (vLLM, llama.cpp in their own venvs), :mod:`.measure` (the interleaved loop),
:mod:`.report` (aggregation, schema, markdown), :mod:`.plots` (PNGs), :mod:`.cli`.
"""

from .measure import run_bench
from .methods import Method, MethodFactory, RunResult
from .prompts import BenchPrompt, load_prompts, select

__all__ = ["BenchPrompt", "Method", "MethodFactory", "RunResult", "load_prompts", "run_bench", "select"]
