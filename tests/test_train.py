"""End-to-end training through the Hydra entry point (subprocess, as a user runs it)."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sinklab

FAST = ["model.n_layer=2", "model.d_model=64", "model.d_ff=128", "data.batch_size=16",
        "trainer.val_check_interval=20", "trainer.limit_val_batches=4", "callbacks.sink.every_n_steps=20",
        "callbacks.checkpoint.every_n_train_steps=20", "optim.warmup_steps=5", "trainer.enable_progress_bar=false"]


def train(out: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sinklab.train.entry", f"paths.output_dir={out}", *FAST, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def column(path: Path, key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows(path) if r.get(key) not in (None, "")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = train(out, "trainer.max_steps=60")
    return out, proc


def test_training_lowers_loss_and_writes_outputs(run):
    out, proc = run
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert (out / "metrics.csv").is_file() and (out / ".hydra" / "config.yaml").is_file()
    losses = column(out / "metrics.csv", "train/loss")
    assert losses[-1][1] < losses[0][1] - 1.0, losses  # from ~8.3 (log 4096) down
    val = column(out / "metrics.csv", "val/loss")
    sink = column(out / "metrics.csv", "sink/sink1")
    assert val and sink and sink[-1][0] == 60  # measured at the end of training
    assert "done: 60 steps" in proc.stdout and "Sink_1" in proc.stdout and "val/loss" in proc.stdout
    assert list((out / "sink_heatmaps").glob("*.png"))
    assert '"status": "completed"' in (out / "status.json").read_text()


def test_load_model_from_run_dir_and_checkpoint(run):
    out, _ = run
    for target in (out, out / "checkpoints" / "last.ckpt"):
        model = sinklab.load_model(target)
        assert not model.training
        idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
        assert model(idx).shape == (2, 16, model.cfg.vocab_size)


def test_resume_from_last_continues_the_step_count(run, tmp_path):
    out, _ = run
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    train(resumed, "trainer.max_steps=80", "ckpt_path=last")
    steps = [s for s, _ in column(resumed / "metrics.csv", "train/loss")]
    assert max(steps) >= 79 and min(s for s in steps if s > 60) > 60
    ckpt = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 80


def test_bad_override_is_one_clear_line(tmp_path):
    proc = train(tmp_path / "bad", "model.window=1000", check=False)
    assert proc.returncode != 0
    assert "model.window=1000 exceeds the context" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wandb_offline_without_key_and_one_run_per_job(tmp_path):
    """logger=wandb with no API key goes offline by itself; each multirun job is its own wandb run, grouped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    env.update(HOME=str(tmp_path), PYTHONWARNINGS="ignore", SINKLAB_CACHE=os.environ.get(
        "SINKLAB_CACHE", str(Path.home() / ".cache" / "sinklab")))
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "sinklab.train.entry", "-m", f"hydra.sweep.dir={sweep}", "logger=wandb",
           *FAST, "trainer.max_steps=4", "callbacks.sink.every_n_steps=2", "seed=0,1", "experiment.name=wb"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(sweep.glob("*/wandb/offline-run-*"))
    assert len(runs) == 2, runs  # one offline run per job, finished before the next job
    groups = set()
    for job in ("0", "1"):
        config, group = wandb_run_record(next((sweep / job / "wandb").glob("offline-run-*/run-*.wandb")))
        assert config["seed"] == int(job) and config["optim"]["lr"] == 2e-3  # swept keys appear as config
        groups.add(group)
    assert len(groups) == 1 and groups.pop().startswith("wb-")  # one group: experiment name + sweep
    assert (sweep / "0" / "metrics.csv").is_file()  # csv stays on next to wandb


def wandb_run_record(path: Path) -> tuple[dict, str]:
    """Read the config and group of an offline wandb run from its transaction log."""
    import json

    from wandb.proto import wandb_internal_pb2

    config, group = {}, ""
    for data in leveldb_log_records(path.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            group = rec.run.run_group or group
            for item in rec.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                config[item.key] = json.loads(item.value_json)
    return config, group


def leveldb_log_records(raw: bytes, block: int = 32768):
    """wandb's transaction log: a 7-byte file header, then LevelDB-log records (crc32, length, type) in 32 KiB
    blocks; types FULL=1, FIRST=2, MIDDLE=3, LAST=4."""
    import struct

    assert raw[:4] == b":W&B", "not a wandb transaction log"
    pos, parts = 7, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        payload = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            parts = payload
        elif kind == 3:
            parts += payload
        elif kind == 4:
            yield parts + payload
        else:
            break
