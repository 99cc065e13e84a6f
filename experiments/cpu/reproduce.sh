#!/usr/bin/env bash
# Regenerate the runs, tables and plots of experiments/cpu/RESULTS.md (the CPU-scale reproduction of Gu et al.).
#
#   bash experiments/cpu/reproduce.sh [OUT_DIR] [NAME ...]
#
# OUT_DIR defaults to logs/cpu_findings; NAMEs pick sweeps (default: all 23 jobs, ~4 hours on 2 cores: each 3000-step job
# takes ~10 min on 2 idle cores, ~19 min when two run side by side on one thread each). The `extra` sweeps run only
# when their NAME is given, at scale=quick (1600 steps, ~4 min per job on one thread, two side by side): issue 15's
# residual_sinks 12 jobs, gate_positions 18, outliers_quant 12, issue 16's sink_uses 10 (~1.7 hours together):
#   bash experiments/cpu/reproduce.sh logs/cpu_findings residual_sinks gate_positions outliers_quant sink_uses
# and issue 17's map of where a sink on an arbitrary first token begins (no BOS): no_bos_map 10 (~50 min), then
# no_bos_tokens 1 (the context-256 model for 19,200 steps, ~35 min) and no_bos_big 1 (the 6-layer width-256 model for
# 4,800 steps, ~46 min), each also measured on 256-token probes (measure_T256.txt in every job dir of context >= 256);
# with them RESULTS.md section 6 used no_bos_seed1 4 (~13 min), no_bos_ctx1024 1 (~8 min) and the BOS controls
# no_bos_with_bos 2 (~18 min) and no_bos_with_bos_long 1 (~12 min).
# outliers_quant's jobs are then evaluated by `sinklab quant`, and its and sink_uses' jobs by `sinklab eval streaming`
# and `sinklab eval intervene`, into OUT_DIR/NAME/{quant,streaming,intervene}.csv (`--sweep`). Each sweep goes to
# OUT_DIR/NAME and its `sinklab report` to OUT_DIR/NAME/report; the window sweep is also measured on probes as long as
# its windows. Every other sweep runs on scale=cpu. RESULTS.md names, for each
# number, the sweep it came from; tests/cli/test_readme.py composes and validates every job listed here.
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

# 4. residual sinks, gate positions, outliers and quantization (issue 15), what sinks are for (issue 16): only when
# named, at scale=quick (the presets' default)
extra residual_sinks experiment=residual_sinks
extra gate_positions experiment=gate_positions seed=0,1
extra outliers_quant experiment=outliers_quant seed=0,1
extra sink_uses      experiment=sink_uses seed=0,1

# 5. where a sink on an arbitrary first token begins (issue 17), at scale=quick, only when named
extra no_bos_map     experiment=no_bos
extra no_bos_tokens  experiment=no_bos experiment.variant=ctx_mid trainer.max_steps=19200
extra no_bos_big     experiment=no_bos experiment.variant=deep_wide trainer.max_steps=4800
extra no_bos_seed1   experiment=no_bos experiment.variant=ctx_short,ctx_mid,ctx_long,wd_zero seed=1
extra no_bos_ctx1024 experiment=no_bos experiment.variant=ctx_long model.block_size=1024 data.batch_size=1
extra no_bos_with_bos      experiment=no_bos experiment.variant=ctx_mid,deep_wide data.bos=true data.probe_bos=true
extra no_bos_with_bos_long experiment=no_bos experiment.variant=ctx_mid data.bos=true data.probe_bos=true trainer.max_steps=6400
for name in no_bos_map no_bos_tokens no_bos_big no_bos_seed1 no_bos_ctx1024 no_bos_with_bos no_bos_with_bos_long; do
  if named "$name"; then  # the models of context >= 256 (all but ctx_short's 64) also on probes of 256 tokens
    for job in "$OUT/$name"/*/; do
      grep -q "experiment.variant=ctx_short" "$job/.hydra/overrides.yaml" && continue
      sinklab measure "$job" --seq-len 256 | tee "$job/measure_T256.txt"
    done
  fi
done
if named outliers_quant; then
  sinklab quant --sweep "$OUT/outliers_quant"   # sinklab quant per job -> JOB/quant.json, quant.csv
fi
for name in outliers_quant sink_uses; do
  if named "$name"; then
    sinklab eval intervene --sweep "$OUT/$name"
    sinklab eval streaming --sweep "$OUT/$name" --first 0,1,4 --recent 16,60
  fi
done

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
