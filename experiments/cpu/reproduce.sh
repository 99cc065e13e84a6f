#!/usr/bin/env bash
# Regenerate the runs, tables and plots of experiments/cpu/RESULTS.md (the CPU-scale reproduction of Gu et al.).
#
#   bash experiments/cpu/reproduce.sh [OUT_DIR] [NAME ...]
#
# OUT_DIR defaults to logs/cpu_findings; NAMEs pick sweeps (default: all 23 jobs, ~4 hours on 2 cores: each 3000-step job
# takes ~10 min on 2 idle cores, ~19 min when two run side by side on one thread each). The `extra` sweeps (issue 15:
# residual_sinks 12 jobs, gate_positions 9, outliers_quant 6, ~4.5 hours together) run only when their NAME is given:
#   bash experiments/cpu/reproduce.sh logs/cpu_findings residual_sinks gate_positions outliers_quant
# outliers_quant's jobs are then evaluated by `sinklab quant` into OUT_DIR/outliers_quant/quant.csv. Each sweep goes to
# OUT_DIR/NAME and its `sinklab report` to OUT_DIR/NAME/report; the window sweep is also measured on probes as long as
# its windows. Every sweep runs on scale=cpu (the experiment presets default to it). RESULTS.md names, for each
# number, the sweep it came from; tests/test_readme.py composes and validates every job listed here.
set -euo pipefail
OUT=${1:-logs/cpu_findings}
shift || true
ONLY=" $* "
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

wanted() {  # NAME: no NAMEs were given, or NAME is one of them
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $1 "* ]]
}

named() {  # NAME: NAME is one of the NAMEs given
  [[ "$ONLY" == *" $1 "* ]]
}

sweep() {  # NAME OVERRIDE...: one multirun into $OUT/NAME, then its report
  local name=$1
  shift
  wanted "$name" || return 0
  echo "== $name: sinklab-train -m $*"
  local start=$SECONDS
  sinklab-train -m hydra.sweep.dir="$OUT/$name" trainer.enable_progress_bar=false "$@"
  sinklab report "$OUT/$name" --out "$OUT/$name/report"
  echo "== $name took $(( (SECONDS - start) / 60 )) min"
}

extra() {  # NAME OVERRIDE...: a sweep that runs only when NAME is given (not part of the default, all)
  named "$1" || return 0
  sweep "$@"
}

# 1. the recipe, three seeds (Sink_1 over steps)
sweep recipe       scale=cpu seed=0,1,2
# 3. the findings
sweep lr           scale=cpu optim.lr=2e-3 seed=0,1
sweep wd           experiment=weight_decay optim.weight_decay=0.1,5.0
sweep wd_seed1     experiment=weight_decay optim.weight_decay=0.1 seed=1
sweep bias         experiment=biases model/bias=k,v,kv,sink_token
sweep attn         experiment=attention_operation model/attn=sigmoid,sigmoid_norm
sweep attn_seed1   experiment=attention_operation model/attn=sigmoid_norm seed=1
sweep unique       experiment=data_amount experiment.variant=100M seed=0,1
sweep fixed_token  experiment=fixed_token_position data.fixed_token.position=2
sweep random       experiment=random_tokens "data.random_positions=[1],[1,2]"
sweep no_bos       scale=cpu data.bos=false data.probe_bos=false
sweep window       experiment=window experiment.variant=w512,w1024 seed=2

# 4. residual sinks, gate positions, outliers and quantization (issue 15): only when named
extra residual_sinks experiment=residual_sinks
extra gate_positions experiment=gate_positions
extra outliers_quant experiment=outliers_quant
if named outliers_quant; then
  bash "$(dirname "$0")/quant_sweep.sh" "$OUT/outliers_quant"   # sinklab quant --json per job -> quant.csv
fi

# the window models measured on probes no longer than their windows (16 and 32 tokens), where every query sees
# token 1; the recipe's seed-2 model measured the same way for comparison
if wanted window; then
  for job in 0:16 1:32; do
    sinklab measure "$OUT/window/${job%%:*}" --seq-len "${job##*:}" | tee "$OUT/window/${job%%:*}/measure_T${job##*:}.txt"
  done
  for T in 16 32; do
    sinklab measure "$OUT/recipe/2" --seq-len "$T" | tee "$OUT/recipe/2/measure_T$T.txt"
  done
fi
