#!/usr/bin/env bash
# A CPU rehearsal of the GPU check on a stock GPU image (issue 39): a fresh Python 3.12 venv holding only torch 2.11
# and the image's packages that sinklab uses, at the image's versions, then the wheels of scripts/gpu_wheels.sh
# installed as on the image (--no-index --no-deps --target, on PYTHONPATH), then the CPU-runnable steps of the
# checklist with that interpreter, through scripts/gpu_checks.sh where it has the step:
#
#   bash scripts/rehearse_gpu_image.sh [WORKDIR]      # default .cache/gpu-image (ignored); CI runs it (.ci/run)
#
#   env          sinklab imports (sinklab.train.entry, sinklab.cli) and the versions it sees
#   prepare      `sinklab prepare` of a jsonl corpus of this checkout's text, with the --prepare wheels (datasets,
#                dill, multiprocess) on PYTHONPATH for this step only: the steps after it run without datasets
#   paper        gpu_checks.sh's scale=paper step made tiny and put on the CPU (PAPER_ARGS), CSV logger, from the
#                prepared directory, then `sinklab measure` of its checkpoint
#   cuda-tests   python -m pytest -m cuda tests/integration/test_cuda.py: collected, every test skipped on the CPU
#   bench        scripts/bench.py --config tiny --data random --steps 2 --skip metric data compile
#
# torch: 2.11.0 from PyTorch's CPU index when it answers (TORCH_INDEX_URL overrides; empty: PyPI), else PyPI's
# torch==2.11.0, the CUDA 13 build of the image itself with its nvidia-* libraries (~3.5 GB; it runs on the CPU).
# PYTHON: the interpreter the venv is made from (default: python3.12 or a pyenv 3.12, the image's Python). Exit 0 when
# every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-.cache/gpu-image}
TORCH=torch==2.11.0
# the image's packages that sinklab imports or its tests need, pinned where the image's version is known (issue 39)
IMAGE=(lightning==2.6.6 pytorch-lightning==2.6.6 transformers==5.17.0 tokenizers==0.23.2 numpy==2.5.2
       safetensors==0.8.0 huggingface-hub==1.33.0 pandas matplotlib scipy einops pytest pytest-xdist pyarrow xxhash
       fsspec aiohttp tqdm pyyaml requests tabulate)
ABSENT=(hydra omegaconf antlr4 datasets dill multiprocess wandb submitit hydra_plugins)  # not on the image
PREPARE_ONLY='/(datasets|dill|multiprocess)-[^/]*\.whl$'  # the --prepare wheels
t0=$SECONDS

python312() {  # PYTHON, python3.12, a pyenv 3.12 or python3: the first that is a Python 3.12
  local c
  for c in ${PYTHON:-} python3.12 "$(pyenv root 2>/dev/null || echo /none)"/versions/3.12*/bin/python3.12 python3; do
    "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo "$c"; return 0; }
  done
  return 1
}
PY312=$(python312) || { echo "error: no Python 3.12 found (the image's; set PYTHON=/path/to/python3.12)" >&2; exit 2; }
if [ -n "$(ls -A "$WORK" 2>/dev/null)" ] && [ ! -d "$WORK/venv" ]; then  # it is removed and made again
  echo "error: WORKDIR=$WORK holds files but no venv/ of an earlier rehearsal; pass an empty or new folder" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
WORK=$(realpath "$WORK")
VENV=$WORK/venv VPY=$WORK/venv/bin/python OUT=$WORK/out
"$PY312" -m venv "$VENV"
"$VPY" -m pip install -q --upgrade pip
if [ -z "${TORCH_INDEX_URL+x}" ]; then
  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
  "$VPY" -c "import urllib.request; urllib.request.urlopen('$TORCH_INDEX_URL/torch/', timeout=20)" 2>/dev/null \
    || TORCH_INDEX_URL=
fi
echo "== torch: $TORCH from ${TORCH_INDEX_URL:-PyPI (the CUDA build)}"
# torch alone, then what it requires one package at a time, with no pip cache: PyPI's CUDA build is ~3.5 GB of wheels
# that become 5.4 GB in the venv, and pip holds every wheel of one command until its end, so one command would need ~9
# GB at its peak (estimated: the wheels beside the venv) and leave 3.5 GB in the cache (CI ran out of disk there once);
# this way the peak is the venv and its largest wheel. A requirement whose marker does not match (an extra's) is ignored
# by pip, as in one command
export PIP_NO_CACHE_DIR=1
"$VPY" -m pip install -q --no-deps "$TORCH" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
mapfile -t needs < <("$VPY" -c "import importlib.metadata as m; print(*m.requires('torch') or [], sep='\n')")
for r in "${needs[@]}"; do "$VPY" -m pip install -q --no-warn-conflicts "$r"; done  # (torch not named: pip would
# fetch all it needs; --no-warn-conflicts: until the last, torch needs what is not yet installed)
"$VPY" -m pip install -q "${IMAGE[@]}" "$TORCH"  # torch named again: nothing may replace it
echo "== venv: $((SECONDS - t0)) s"
for m in "${ABSENT[@]}"; do  # the rehearsal is only as good as the venv is like the image
  if "$VPY" -c "import $m" 2>/dev/null; then echo "error: $m is importable in $VENV; the image has none" >&2; exit 1; fi
done

bash scripts/gpu_wheels.sh --prepare "$WORK/whl"
mapfile -t wheels < <(ls "$WORK"/whl/*.whl)
base=() prep=()
for w in "${wheels[@]}"; do if [[ $w =~ $PREPARE_ONLY ]]; then prep+=("$w"); else base+=("$w"); fi; done
install() { "$VPY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
install "$WORK/site" "${base[@]}"
install "$WORK/site-prepare" "${prep[@]}"

export PYTHON=$VPY PYTHONPATH=$WORK/site OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
checks() { bash scripts/gpu_checks.sh "$OUT" "$@"; }
TAIL=3 checks env
"$VPY" scripts/text_corpus.py --out "$WORK/corpus.jsonl" --ext .py .md --max-mb 1 sinklab docs README.md
s=$SECONDS
PYTHONPATH=$WORK/site:$WORK/site-prepare "$VPY" -m sinklab prepare --files "$WORK/corpus.jsonl" \
  --group-field group --vocab-size 512 --num-proc 1 --no-progress --out "$WORK/prepared" >"$OUT/prepare.log" 2>&1 \
  && rc=0 || rc=$?
echo "== prepare: exit $rc in $((SECONDS - s)) s" | tee -a "$OUT/steps.txt"
tail -n 1 "$OUT/prepare.log"
PAPER_DATA=$WORK/prepared PAPER_DEVICE=cpu PAPER_TIME=00:00:03:00 PAPER_LIMIT=240 PAPER_MEASURE_TIME=120 TAIL=3 \
  PAPER_ARGS="model=tiny model.block_size=64 data.batch_size=4 data.num_workers=0 trainer.accumulate_grad_batches=1
    trainer.max_steps=6 trainer.val_check_interval=3 trainer.limit_val_batches=2 callbacks.sink.every_n_steps=3
    callbacks.checkpoint.every_n_train_steps=3 trainer.accelerator=cpu trainer.strategy=auto trainer.precision=32" \
  checks paper | cut -c 1-200  # the measurement's JSON is one long line
XDIST_N=0 TAIL=2 checks cuda-tests
s=$SECONDS
timeout 300 "$VPY" scripts/bench.py --config tiny --data random --steps 2 --skip metric data compile \
  >"$OUT/bench.log" 2>&1 && rc=0 || rc=$?
echo "== bench: exit $rc in $((SECONDS - s)) s" | tee -a "$OUT/steps.txt"
tail -n 2 "$OUT/bench.log"

# every step exited 0; the CUDA tests were collected and skipped (none ran, none failed); the run measured
failed=$(grep -v ": exit 0 " "$OUT/steps.txt" || true)
grep -Eq "^[0-9]+ skipped" "$OUT/cuda_tests.log" && ! grep -Eq "[0-9]+ (passed|failed|error)" "$OUT/cuda_tests.log" \
  || failed+=$'\n'"cuda-tests: not every CUDA test was collected and skipped ($OUT/cuda_tests.log)"
grep -q '"sink"' "$OUT/paper_measure.log" || failed+=$'\n'"paper_measure: no measurement ($OUT/paper_measure.log)"
echo "== rehearsal: $((SECONDS - t0)) s in all (logs in $OUT)"
if [ -n "${failed//$'\n'/}" ]; then
  echo "error: the rehearsal failed:$failed" >&2
  exit 1
fi
