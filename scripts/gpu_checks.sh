#!/usr/bin/env bash
# The GPU checklist on one CUDA machine (docs/performance.md, "GPU"): the CUDA tests, the unit suite, the 60m bf16
# benchmark per attention path, and a short scale=paper run measured afterwards. Each step has its own time limit
# and its own log under OUTDIR; a failing step does not stop the others.
#
#   bash scripts/gpu_checks.sh OUTDIR STEP [STEP ...]
#     cuda-tests        python -m pytest -m cuda tests/integration/test_cuda.py (pytest-xdist workers if installed)
#     suite             the README's unit suite, on the CPU cores of the GPU machine
#     bench-NAME        scripts/bench.py --config 60m --device cuda --dtype bf16 --data random --batch 16 --compile
#                       for NAME in softmax_sdpa softmax_flex sink_logit alibi sigmoid_linear (BENCH_ARGS adds flags)
#     paper             sinklab-train scale=paper on one device (PAPER_DATA: a `sinklab prepare` dir; PAPER_TIME:
#                       Lightning's max_time, default 00:00:05:00; PAPER_ARGS: more overrides), then `sinklab measure`
#                       of its last checkpoint on PAPER_DEVICE (default cuda)
#     env               the device, the driver and the versions of what sinklab imports (env.log)
#     pack DEST         the figures' summary lines into DEST/summary.txt and every log into DEST/logs.tgz (two
#                       files, for a machine that returns few files)
#
# XDIST_N replaces the pytest-xdist worker counts of cuda-tests and suite (0: one process).
#
# The softmax_sdpa bench also times the sink callback and a Lightning fit; the others only the eager and compiled
# steps against the plain reference and the matmul peak (BENCH_SKIP replaces that list).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_checks.sh OUTDIR STEP...}
shift
mkdir -p "$OUT"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}  # sinklab importable from this checkout, installed or not (module entry points below)

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log to OUT/NAME.log, print its last lines
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
  tail -n "${TAIL:-4}" "$OUT/$name.log"
}

declare -A VARIANT=(
  [softmax_sdpa]=""
  [softmax_flex]="--set model.attn_backend=flex"
  [sink_logit]="--set model/attn=sink_logit --set model.attn_backend=flex"
  [alibi]="--set model/pos=alibi --set model.attn_backend=flex"
  [sigmoid_linear]="--set model/attn=sigmoid --set model.attn_memory=linear"
)

xdist() { $PY -c "import xdist" 2>/dev/null && echo "-n ${XDIST_N:-$1}"; }

steps=() dest=
while [ $# -gt 0 ]; do
  if [ "$1" = pack ]; then dest=${2:?pack needs a DEST folder}; shift 2; else steps+=("$1"); shift; fi
done
for s in "${steps[@]}"; do
  case $s in
    cuda-tests)
      step cuda_tests "${CUDA_TESTS_TIME:-240}" $PY -m pytest -m cuda tests/integration/test_cuda.py -q -rs $(xdist 6) ;;
    suite)
      step suite "${SUITE_TIME:-300}" env OMP_NUM_THREADS=1 $PY -m pytest -m "not slow and not cuda" -q \
        -p no:cacheprovider $(xdist 12) ;;
    bench-*)
      name=${s#bench-}
      [ -n "${VARIANT[$name]+x}" ] || { echo "error: unknown step $s; allowed: bench-{${!VARIANT[*]}}" >&2; exit 2; }
      # shellcheck disable=SC2086
      skip=${BENCH_SKIP:-metric data callback lightning}
      [ "$name" = softmax_sdpa ] && skip=${BENCH_SKIP:-metric data}
      step "bench_$name" "${BENCH_TIME:-150}" $PY scripts/bench.py --config 60m --device cuda --dtype bf16 \
        --data random --batch 16 --steps "${BENCH_STEPS:-10}" --compile --skip $skip ${VARIANT[$name]} \
        ${BENCH_ARGS:-} --json "$OUT/bench_$name.json" ;;
    paper)
      run="$OUT/paper_run"
      step paper_train "${PAPER_LIMIT:-420}" $PY -m sinklab.train.entry scale=paper trainer.devices=1 \
        trainer.accumulate_grad_batches=32 data=local "data.prepared_dir=${PAPER_DATA:?PAPER_DATA: a prepared dir}" \
        data.num_workers=4 "trainer.max_time=${PAPER_TIME:-00:00:05:00}" trainer.val_check_interval=640 \
        trainer.limit_val_batches=16 callbacks.sink.every_n_steps="${PAPER_SINK_EVERY:-10}" \
        callbacks.checkpoint.every_n_train_steps=50 trainer.enable_progress_bar=false "paths.output_dir=$run" \
        ${PAPER_ARGS:-}
      step paper_measure "${PAPER_MEASURE_TIME:-120}" $PY -m sinklab measure "$run" \
        --device "${PAPER_DEVICE:-cuda}" --json
      cp "$run/metrics.csv" "$OUT/paper_metrics.csv" 2>/dev/null ;;
    env)
      step env 60 bash -c "nvidia-smi; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA device\")'; $PY -m pip list 2>/dev/null | grep -i -E '^(torch|triton|lightning|pytorch-lightning|hydra-core|omegaconf|datasets|transformers|tokenizers|numpy|pandas|pyarrow|huggingface.hub|einops|scipy) '; $PY -c 'import sinklab.train.entry, sinklab.cli; print(\"sinklab imports\")'" ;;
    *)
      echo "error: unknown step $s; allowed: env, cuda-tests, suite, bench-NAME, paper, pack DEST" >&2; exit 2 ;;
  esac
done

# pack DEST: the summary lines of every figure, then every log, into two files under DEST
if [ -n "$dest" ]; then
  mkdir -p "$dest"
  { cat "$OUT/steps.txt" 2>/dev/null
    for f in "$OUT"/*.log; do
      case $f in
        *measure.log) head -c 4000 "$f" ;;  # its JSON
        *) grep -h -E "^(setup|train tokens/s|sinklab / reference|matmul peak|MFU|sink callback share|lightning|logged perf|compile speed-up|total|done:|sink:|== )|[0-9]+ (passed|failed)|error:|Error" "$f" ;;
      esac | sed "s|^|$(basename "$f" .log): |" | head -n 60
    done; } >"$dest/summary.txt"
  tar -czf "$dest/logs.tgz" --exclude="*.ckpt" -C "$OUT" .  # a checkpoint is 0.5 GB at 60m
fi
