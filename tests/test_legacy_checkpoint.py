"""A checkpoint written by sinklab 0.1 (before the plug-in redesign; tests/data, a 1-layer sigmoid model with a KV
bias and a headwise gate) still loads, gives the logits 0.1 gave, and resumes training."""
import os
import subprocess
import sys
from pathlib import Path

import torch

import sinklab

DATA = Path(__file__).parent / "data"
OLD = DATA / "ckpt_v0_1_sigmoid_kv_headwise.ckpt"


def test_a_0_1_checkpoint_loads_with_the_same_logits():
    model = sinklab.load_model(OLD)
    assert model.cfg.attn_op == "sigmoid" and model.cfg.attn_bias == "kv" and model.cfg.gate == "headwise"
    assert model.blocks[0].attn.attn_bias.k_bias.abs().sum() > 0  # the renamed parameters were loaded
    want = torch.load(DATA / "ckpt_v0_1_logits.pt")
    with torch.no_grad():
        torch.testing.assert_close(model(want["idx"]), want["logits"], atol=0, rtol=0)


def test_a_0_1_checkpoint_resumes_training(tmp_path):
    out = tmp_path / "run"
    args = ["trainer.max_steps=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=32",
            "data.vocab_size=258", "model/bias=kv", "model/attn=sigmoid_norm", "model/gate=headwise",
            "callbacks.sink=null", "trainer.enable_progress_bar=false", f"ckpt_path={OLD}", f"paths.output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "sinklab.train.entry", *args], capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "offline"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: 4 steps" in proc.stdout
    assert "resuming from" in proc.stderr + (out / "train.log").read_text()
