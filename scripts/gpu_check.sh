#!/usr/bin/env bash
# The whole GPU check as one command of at most 8 minutes (issue 39), for a CUDA machine lent for a short time:
#
#   bash scripts/gpu_check.sh DEST [PREPARED_DIR]
#
# in order, each step under its own time limit (scripts/gpu_checks.sh runs them):
#   env                                       the device, driver and versions (10 s)
#   bench-softmax_sdpa                        60m, context 2048, bf16, eager and compiled, MFU against the measured
#                                             matmul peak and the datasheet's, the sink callback's share and a
#                                             Lightning fit (110 s)
#   bench-softmax_flex, bench-sink_logit,     the same model through FlexAttention, with the sink logit, and the
#   bench-sigmoid_linear                      memory-linear sigmoid path; eager and compiled only (70 s each)
#   paper | cuda-tests                        side by side (the GPU has room for both; the paper run's throughput
#                                             is then not a benchmark figure): scale=paper for 80 s of training on
#                                             PREPARED_DIR with Sink_1 every 5 optimizer steps, then
#                                             `sinklab measure`; the CUDA tests (130 s)
# then DEST holds summary.txt (a line per figure), logs.tgz (every log and JSON) and paper_metrics.csv.
# Without PREPARED_DIR the paper step is left out. GPU_CHECK_STEPS replaces the bench list (e.g. for a rerun).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: gpu_check.sh DEST [PREPARED_DIR]}
DATA=${2:-}
[ -z "$DATA" ] || [ -f "$DATA/manifest.json" ] || { echo "error: PREPARED_DIR=$DATA has no manifest.json (make one with sinklab prepare)" >&2; exit 2; }
mkdir -p "$DEST"
LOGS=$(mktemp -d /tmp/gpu_check.XXXXXX)
checks=scripts/gpu_checks.sh
t0=$SECONDS
BENCH_TIME=10 bash $checks "$LOGS" env >/dev/null
BENCH_STEPS=${BENCH_STEPS:-8} BENCH_TIME=110 bash $checks "$LOGS" ${GPU_CHECK_SDPA-bench-softmax_sdpa}
BENCH_STEPS=${BENCH_STEPS:-8} BENCH_TIME=70 bash $checks "$LOGS" \
  ${GPU_CHECK_STEPS-bench-softmax_flex bench-sink_logit bench-sigmoid_linear}
if [ -n "$DATA" ]; then
  PAPER_DATA=$DATA PAPER_TIME=00:00:01:20 PAPER_LIMIT=125 PAPER_SINK_EVERY=5 PAPER_MEASURE_TIME=40 bash $checks "$LOGS" paper &
fi
CUDA_TESTS_TIME=130 bash $checks "$LOGS" cuda-tests
wait
cp "$LOGS/paper_metrics.csv" "$DEST/" 2>/dev/null
bash $checks "$LOGS" pack "$DEST" >/dev/null
echo "== gpu_check: $((SECONDS - t0)) s in all"
cat "$DEST/summary.txt"
