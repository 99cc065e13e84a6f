#!/usr/bin/env bash
# One `sinklab` evaluation over every job of a sweep, gathered into one CSV (issues 15 and 16).
#
#   bash experiments/cpu/eval_sweep.sh SWEEP_DIR EVAL [its options ...]      EVAL: quant | streaming | intervene
#   bash experiments/cpu/eval_sweep.sh logs/train/multiruns/<time> streaming --first 0,4 --recent 32
#   bash experiments/cpu/eval_sweep.sh logs/train/multiruns/<time> intervene
#   JOBS="0 1 2" bash experiments/cpu/eval_sweep.sh logs/train/multiruns/<time> quant    # only these job dirs
#
# For each job dir of SWEEP_DIR (0, 1, ...) that has checkpoints/last.ckpt, runs `sinklab quant JOB --json` (quant)
# or `sinklab eval EVAL JOB --json` with the options given into JOB/EVAL.json; a job without a checkpoint is skipped
# with a line on stderr. Then writes SWEEP_DIR/EVAL.csv, one row per evaluated job: `job` (the key of the `job` column
# of `sinklab report`'s report.csv), the job's overrides, then
#   quant:      for fp32 and each scheme <scheme>_loss, _ppl, _gap (ppl - fp32 ppl), _rel_gap (gap / fp32 ppl); then
#               val_targets, calib_batches, weights;
#   streaming:  for each setting (x4_y60, x0_y60, ..., dense, recompute) <setting>_ppl, <setting>_keys; n_tokens;
#   intervene:  massive_layer (from 0, as the log keys layer0/... and every output), massive_token (from 1: token 1
#               is the first), massive_ratio; for each row (none, zero, mean, mask_first, mask_random)
#               <row>_ppl, _dppl, _sink1, _alpha1 (and _sink1_star where the op is unnormalised).
set -euo pipefail
USAGE="usage: bash experiments/cpu/eval_sweep.sh SWEEP_DIR quant|streaming|intervene [options ...]"
SWEEP=${1:?$USAGE}
EVAL=${2:?$USAGE}
shift 2
[ -d "$SWEEP" ] || { echo "eval_sweep.sh: SWEEP_DIR $SWEEP is not a directory" >&2; exit 2; }
case "$EVAL" in
  quant) COMMAND=(sinklab quant) ;;
  streaming|intervene) COMMAND=(sinklab eval "$EVAL") ;;
  *) echo "eval_sweep.sh: EVAL $EVAL is not one of quant, streaming, intervene" >&2; exit 2 ;;
esac

for job in "$SWEEP"/*/; do
  job=${job%/}
  [[ $(basename "$job") =~ ^[0-9]+$ ]] || continue
  if [ -n "${JOBS:-}" ] && [[ " $JOBS " != *" $(basename "$job") "* ]]; then continue; fi
  if [ ! -f "$job/checkpoints/last.ckpt" ]; then
    echo "== $job: no checkpoints/last.ckpt (not finished?), skipped" >&2
    continue
  fi
  echo "== ${COMMAND[*]} $job --json $*"
  "${COMMAND[@]}" "$job" --json "$@" > "$job/$EVAL.json.tmp"
  mv "$job/$EVAL.json.tmp" "$job/$EVAL.json"
done

python - "$SWEEP" "$EVAL" <<'PY'
import json, sys
from pathlib import Path

import pandas as pd
import yaml


def quant(res):
    row = {f"{scheme}_{k}": r[k] for scheme, r in res["schemes"].items() for k in ("loss", "ppl", "gap", "rel_gap")}
    return {**row, **{k: res[k] for k in ("val_targets", "calib_batches", "weights")}}


def streaming(res):
    def column(s):  # x4_y60 for a streaming cache, dense / recompute for the baselines
        return f"x{s['first']}_y{s['recent']}" if s["kind"] == "streaming" else s["kind"]

    row = {f"{column(s)}_{k}": s[k] for s in res["settings"] for k in ("ppl", "keys")}
    return {**row, "n_tokens": res["n_tokens"]}


def intervene(res):
    m = res["massive"]
    row = {"massive_layer": m["layer"], "massive_token": m["token"], "massive_ratio": m["ratio"]}
    row.update({f"{name}_{k}": v for name, r in res["rows"].items() for k, v in r.items() if k != "loss"})
    return row


sweep, kind = Path(sys.argv[1]), sys.argv[2]
rows = []
done = [p for p in sweep.glob(f"*/{kind}.json") if p.parent.name.isdigit()]
for path in sorted(done, key=lambda p: int(p.parent.name)):
    overrides = yaml.safe_load((path.parent / ".hydra" / "overrides.yaml").read_text()) or []
    row = {"job": path.parent.name, **dict(o.split("=", 1) for o in overrides if "=" in o)}
    rows.append({**row, **{"quant": quant, "streaming": streaming, "intervene": intervene}[kind](
        json.loads(path.read_text()))})
if not rows:
    sys.exit(f"eval_sweep.sh: no job of {sweep} has a {kind}.json (no finished job with a checkpoint)")
out = sweep / f"{kind}.csv"
pd.DataFrame(rows).to_csv(out, index=False)
print(f"wrote {out} ({len(rows)} jobs)")
PY
