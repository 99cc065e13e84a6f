"""A checkpoint written by sinklab 0.1 (before the plug-in redesign; tests/golden, a 1-layer sigmoid model with a KV
bias and a headwise gate) still loads, gives the logits 0.1 gave, and resumes training.

The logits are compared within LOGITS_ATOL. Measured with `python scripts/golden_spread.py` (AMD EPYC with AVX-512,
torch 2.13.0+cpu): the greatest absolute difference from the recorded logits (|logit| <= 2.61) is 0 with the avx2
and avx512 kernel sets at 1 and 2 threads and 7.2e-7 with ATEN_CPU_CAPABILITY=default (the same 7.2e-7 an Intel
Xeon with AVX-512 gave, issue 24); the smallest real changes move them by 4.8e-4 (softmax scale 1.001) and 1.3e-3
(norm_eps 1e-5 -> 1e-6), which the last test checks.
"""
import logging

import pytest
import torch

import sinklab
from tests.golden import goldens
from tests.helpers import train

LOGITS_ATOL = 1e-5


def test_a_0_1_checkpoint_loads_with_the_same_logits():
    model = sinklab.load_model(goldens.LEGACY_CKPT)
    assert model.cfg.attn_op == "sigmoid" and model.cfg.attn_bias == "kv" and model.cfg.gate == "headwise"
    assert model.blocks[0].attn.attn_bias.k_bias.abs().sum() > 0  # the renamed parameters were loaded
    want = torch.load(goldens.LEGACY_LOGITS)["logits"]
    assert goldens.logits_deviation(goldens.legacy_logits(), want) <= LOGITS_ATOL


@pytest.mark.parametrize("change", [{"norm_eps": 1e-6}, {"softmax_scale": 1.001}], ids=["norm_eps", "softmax_scale"])
def test_a_small_real_change_fails_the_logits_comparison(change):
    want = torch.load(goldens.LEGACY_LOGITS)["logits"]
    assert goldens.logits_deviation(goldens.legacy_logits(**change), want) > LOGITS_ATOL


def test_a_0_1_checkpoint_resumes_training(tmp_path, caplog, capsys):
    args = ["trainer.max_steps=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=32",
            "data.vocab_size=258", "model/bias=kv", "model/attn=sigmoid_norm", "model/gate=headwise",
            "callbacks.sink=null", "trainer.enable_progress_bar=false", f"ckpt_path={goldens.LEGACY_CKPT}"]
    with caplog.at_level(logging.INFO, logger="sinklab"):
        train(tmp_path / "run", recipe=args, job=False)
    assert f"resuming from {goldens.LEGACY_CKPT} (step 2)" in caplog.text
    assert "done: 4 steps" in capsys.readouterr().out
