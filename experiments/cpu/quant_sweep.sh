#!/usr/bin/env bash
# `sinklab quant` over every job of a sweep, gathered into SWEEP_DIR/quant.csv (issue 15; used for
# experiment=outliers_quant): `eval_sweep.sh SWEEP_DIR quant`, which says what the CSV holds.
#
#   bash experiments/cpu/quant_sweep.sh SWEEP_DIR [sinklab quant options ...]
#   bash experiments/cpu/quant_sweep.sh logs/train/multiruns/<time> --schemes w8a8 w4a4 --weights per-channel
set -euo pipefail
SWEEP=${1:?usage: bash experiments/cpu/quant_sweep.sh SWEEP_DIR [sinklab quant options ...]}
shift
exec bash "$(dirname "$0")/eval_sweep.sh" "$SWEEP" quant "$@"
