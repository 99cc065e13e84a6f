#!/usr/bin/env bash
# `sinklab quant` over every job of a sweep, gathered into one CSV (issue 15; used for experiment=outliers_quant).
#
#   bash experiments/cpu/quant_sweep.sh SWEEP_DIR [sinklab quant options ...]
#   bash experiments/cpu/quant_sweep.sh logs/train/multiruns/<time> --schemes w8a8 w4a4 --weights per-channel
#
# For each job dir of SWEEP_DIR (0, 1, ...) that has checkpoints/last.ckpt, runs `sinklab quant JOB --json` with the
# options given (default: every scheme, per-tensor weights, 8 calibration batches) into JOB/quant.json; a job
# without a checkpoint is skipped with a line on stderr. Then writes SWEEP_DIR/quant.csv, one row per evaluated job:
# `job` (the same key as the `job` column of `sinklab report`'s report.csv), the job's overrides, then for fp32 and
# each scheme `<scheme>_loss`, `<scheme>_ppl`, `<scheme>_gap` (ppl - fp32 ppl) and `<scheme>_rel_gap` (gap / fp32
# ppl), then `val_targets`, `calib_batches`, `weights`.
set -euo pipefail
SWEEP=${1:?usage: bash experiments/cpu/quant_sweep.sh SWEEP_DIR [sinklab quant options ...]}
shift
[ -d "$SWEEP" ] || { echo "quant_sweep.sh: SWEEP_DIR $SWEEP is not a directory" >&2; exit 2; }

for job in "$SWEEP"/*/; do
  job=${job%/}
  [[ $(basename "$job") =~ ^[0-9]+$ ]] || continue
  if [ ! -f "$job/checkpoints/last.ckpt" ]; then
    echo "== $job: no checkpoints/last.ckpt (not finished?), skipped" >&2
    continue
  fi
  echo "== sinklab quant $job --json $*"
  sinklab quant "$job" --json "$@" > "$job/quant.json.tmp"
  mv "$job/quant.json.tmp" "$job/quant.json"
done

python - "$SWEEP" <<'PY'
import json, sys
from pathlib import Path

import pandas as pd
import yaml

sweep = Path(sys.argv[1])
rows = []
done = [p for p in sweep.glob("*/quant.json") if p.parent.name.isdigit()]
for path in sorted(done, key=lambda p: int(p.parent.name)):
    res = json.loads(path.read_text())
    overrides = yaml.safe_load((path.parent / ".hydra" / "overrides.yaml").read_text()) or []
    row = {"job": path.parent.name, **dict(o.split("=", 1) for o in overrides if "=" in o)}
    for scheme, r in res["schemes"].items():
        row.update({f"{scheme}_{k}": r[k] for k in ("loss", "ppl", "gap", "rel_gap")})
    row.update({k: res[k] for k in ("val_targets", "calib_batches", "weights")})
    rows.append(row)
if not rows:
    sys.exit(f"quant_sweep.sh: no job of {sweep} has a quant.json (no finished job with a checkpoint)")
out = sweep / "quant.csv"
pd.DataFrame(rows).to_csv(out, index=False)
print(f"wrote {out} ({len(rows)} jobs)")
PY
