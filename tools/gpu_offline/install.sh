# sourced by call1.sh / call2.sh on the GPU machine: this checkout and the carried wheels into /tmp/site
PY=${PY:-python3}  # the GPU machine's python3 holds torch; a dry run here: PY=.venv/bin/python
export PYTHONUNBUFFERED=1 SPECFOUNDRY_CACHE=/tmp/sfcache WANDB_MODE=offline
rm -rf /tmp/w /tmp/site/specfoundry*
"$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/w . \
  && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl .whl/*.whl \
  || { echo "install failed"; exit 3; }
export PYTHONPATH=/tmp/site
