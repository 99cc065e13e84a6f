"""Sweep dirs as a Hydra multirun and Lightning's CSVLogger leave them, written by hand for the report tests: a job's
.hydra/ (config.yaml, overrides.yaml, hydra.yaml) and its metrics.csv."""
import csv
from pathlib import Path

from omegaconf import OmegaConf


def base_config(wd=0.1, seed=0, lr=4e-4):
    return {
        "seed": seed,
        "experiment": {"name": "weight_decay", "paper_table": "weight_decay",
                       "paper_match": {"wd": "optim.weight_decay"}},
        "optim": {"lr": lr, "weight_decay": wd, "betas": [0.9, 0.95], "warmup_steps": 20},
        "trainer": {"max_steps": 300, "devices": 1, "accelerator": "cpu", "precision": "32-true"},
        "model": {"pos": "rope", "attn_op": "softmax", "attn_normalize": True, "attn_bias": "none",
                  "n_sink_tokens": 0, "window": None, "prefix_len": 0, "n_layer": 2, "d_model": 64},
        "data": {"max_unique_tokens": None, "random_positions": [], "fixed_token": {"position": None}},
    }


def write_hydra(job_dir: Path, cfg: dict, overrides: list[str]) -> None:
    h = job_dir / ".hydra"
    h.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(cfg), h / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), h / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"name": "train", "override_dirname": ",".join(overrides)},
                                               "mode": "MULTIRUN"}}), h / "hydra.yaml")


def write_metrics(path: Path, steps, sink1, val_loss, extra_cols=None, truncate=False) -> list[dict]:
    """CSVLogger layout: sorted header, one row per log call, blank cells for metrics not logged in that call
    (train rows every 10 steps, sink/val rows every 50)."""
    rows = []
    for s in range(0, steps + 1, 10):
        rows.append({"step": s, "epoch": 0, "train/loss": 6.0 - s / 100})
        if s % 50 == 0 and s > 0:
            r = {"step": s, "epoch": 0, "val/loss": val_loss(s), "sink/sink1": sink1(s),
                 "sink/sink2": 0.5, "sink/sink3": 0.25, "sink/sink4": 0.0, "sink/alpha1": sink1(s) / 200}
            r.update((extra_cols or {}))
            rows.append(r)
    keys = sorted(set().union(*rows))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    if truncate:  # killed mid-write: the last line lacks its newline and is cut in the middle of a number
        text = path.read_text()
        path.write_text(text + "60,0,,,,,,,5.1")
    return rows
