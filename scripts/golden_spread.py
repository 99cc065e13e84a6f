"""How far the goldens' fp32 numbers move between kernel sets and thread counts on this machine, against how far a
small real change moves them: the measurements behind the tolerances of tests/golden/test_golden.py and
tests/golden/test_legacy_checkpoint.py.

    python scripts/golden_spread.py                      # every kernel set this CPU has x 1 and 2 threads
    python scripts/golden_spread.py --runs fast_plain    # fewer training runs (each ~15 s per setting)

Each setting runs in a fresh process (ATEN_CPU_CAPABILITY is read when torch starts; MKL_ENABLE_INSTRUCTIONS=AVX2
stands in for the BLAS paths of another CPU): every model/ option's initial parameters and 3 AdamW losses
(tests/golden/components.json) and per-position initial losses (token_losses.json), the sinklab 0.1 checkpoint's logits (tests/golden), and the recorded training runs,
trained in process. Printed: per setting, the greatest deviation from the recorded numbers (relative; the logits'
absolute), then the same for the small real changes the goldens must catch (in this process's setting). A tolerance
is sound when it is above every setting's deviation and below every real change's.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY values this CPU can run: default and avx2 on any x86-64 with AVX2, avx512 when it has
    AVX-512 (F, BW, VL and DQ, what torch's AVX512 kernels need)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    caps = ["default"]
    if "avx2" in flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        caps.append("avx512")
    return caps


def settings() -> list[dict[str, str]]:
    out = [{"ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": threads}
           for cap in cpu_capabilities() for threads in ("1", "2")]
    return out + [{"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "2"}]


def worker(out: Path, runs: list[str]) -> None:
    """This process's numbers (its kernel set and thread count) -> `out` (JSON)."""
    import torch

    from tests.golden import goldens

    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "components": {o: goldens.components(o) for o in sorted(goldens.recorded_components())},
            "token_losses": {o: goldens.token_losses(o) for o in sorted(goldens.recorded_token_losses())},
            "logits": goldens.legacy_logits().tolist(),
            "runs": {name: goldens.training_metrics(name, Path(tmp) / name).to_csv(index=False) for name in runs},
        }
    out.write_text(json.dumps(result))


def deviations(result: dict) -> dict[str, object]:
    """The greatest deviation from the recorded numbers of each compared quantity."""
    import pandas as pd
    import torch

    from tests.golden import goldens

    want = goldens.recorded_components()
    comps = result["components"]
    out = {"params": max(goldens.param_deviation(comps[o], want[o]) for o in comps),
           "losses": [max(s) for s in zip(*(goldens.loss_deviation(comps[o], want[o]) for o in comps))],
           "token_losses": max(goldens.token_loss_deviation(v, goldens.recorded_token_losses()[o])
                               for o, v in result["token_losses"].items()),
           "logits": goldens.logits_deviation(torch.tensor(result["logits"]),
                                              torch.load(goldens.LEGACY_LOGITS)["logits"])}
    for name, metrics in result.get("runs", {}).items():
        dev = goldens.metric_deviation(pd.read_csv(io.StringIO(metrics)), goldens.recorded_metrics(name))
        out[name] = dev.groupby("step").max().max(axis=1).to_dict()  # per logged step, over the columns
        out[f"{name} columns"] = dev.drop(columns="step").max().sort_values().tail(5).to_dict()
    return out


# the small real changes the goldens must catch, and the options they are applied to
CHANGES = {"norm_eps 1e-5 -> 1e-6": {"norm_eps": 1e-6},
           "init_std x 1.01": "init",
           "softmax_scale 1.001": {"softmax_scale": 1.001}}
CHANGE_OPTIONS = ["model/norm=pre", "model/attn=softmax", "model/pos=rope", "model/ffn=swiglu"]


def change_of(change, golden: str) -> dict:
    """The config change; "init" is the default init std of the golden's model (an option of components.json, or
    a training run of RUNS) times 1.01."""
    if change != "init":
        return change
    from tests.golden import goldens

    if golden in goldens.RUNS:
        from sinklab.config import compose

        d_model = compose(goldens.RUNS[golden]).model.d_model
    else:
        d_model = goldens.recorded_components()[golden]["config"]["d_model"]
    return {"init_std": (2 / (5 * d_model)) ** 0.5 * 1.01}


def real_changes(runs: list[str]) -> dict[str, dict]:
    """Deviations of the small real changes, in this process's setting."""
    import pandas as pd

    from tests.golden import goldens

    want = goldens.recorded_components()
    out = {}
    for label, change in CHANGES.items():
        row = {}
        for option in CHANGE_OPTIONS:
            got = goldens.components(option, **change_of(change, option))
            row[option] = {"params": goldens.param_deviation(got, want[option]),
                           "losses": goldens.loss_deviation(got, want[option]),
                           "token_losses": goldens.token_loss_deviation(
                               goldens.token_losses(option, **change_of(change, option)),
                               goldens.recorded_token_losses()[option])}
        if change != "init":
            row["logits"] = goldens.logits_deviation(goldens.legacy_logits(**change),
                                                     goldens.legacy_logits())
        with tempfile.TemporaryDirectory() as tmp:
            for name in runs:
                extra = [f"model.{k}={v}" for k, v in change_of(change, name).items()]
                dev = goldens.metric_deviation(goldens.training_metrics(name, Path(tmp) / name, *extra),
                                               goldens.recorded_metrics(name))
                row[name] = dev.groupby("step").max().max(axis=1).to_dict()
        out[label] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="fast_plain,fast_abl", help="recorded training runs to repeat (comma list)")
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    if args.worker:
        worker(args.worker, runs)
        return
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings():
            label = " ".join(f"{k}={v}" for k, v in setting.items())
            path = Path(tmp) / "result.json"
            env = {**os.environ, "WANDB_MODE": "offline", **setting}
            subprocess.run([sys.executable, __file__, "--worker", str(path), "--runs", args.runs], env=env,
                           check=True, capture_output=True)
            report[label] = deviations(json.loads(path.read_text()))
            print(label, json.dumps(report[label]), flush=True)
    report["real changes"] = real_changes(runs)
    for label, row in report["real changes"].items():
        print(label, json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
