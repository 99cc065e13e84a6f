"""Kept checkpoints (callbacks.checkpoint.keep): the schedule (every N steps, log-spaced in tokens seen), its one-line
refusals, and a real run that keeps them beside last.ckpt, weights only, named by step and tokens, while a resume
still starts from last.ckpt and writes the same kept models again."""
from __future__ import annotations

import pytest
import torch

from sinklab.runs.checkpoints import TOKENS_SEEN, kept_checkpoints, load_model, read_checkpoint, read_training_checkpoint
from sinklab.config import compose, validate_config
from sinklab.errors import UserError
from sinklab.train.kept import is_kept, keep_config, log_marks
from tests.helpers import assert_one_line_error, run_cli, small

PER_STEP = 4 * 32  # small(): 4 blocks of 32 tokens per step


def kept_steps(keep: dict, steps: int, per_step: int) -> list[int]:
    schedule = keep_config(keep)
    return [s for s in range(1, steps + 1) if is_kept(schedule, s, per_step)]


def test_the_schedule_every_n_steps_log_spaced_and_both():
    assert kept_steps({"every_n_steps": 400}, 1600, 1024) == [400, 800, 1200, 1600]
    # scale=quick's: 4 per decade of tokens from 16,384 (1024 tokens per step), and every 400 steps
    log = {"log_tokens": {"start": 16384, "per_decade": 4}}
    assert kept_steps(log, 1600, 1024) == [16, 29, 51, 90, 160, 285, 506, 900, 1600]  # 1600 x 1024 = 16384 x 100
    assert kept_steps({**log, "every_n_steps": 400}, 1600, 1024) == [16, 29, 51, 90, 160, 285, 400, 506, 800, 900,
                                                                     1200, 1600]
    # each mark start * 10^(j/k) kept at the first step reaching it; several marks in one step keep it once
    assert kept_steps({"log_tokens": {"start": 100, "per_decade": 1}}, 100, 100) == [1, 10, 100]
    # marks 1, 2.2, 4.6, ..., 1000 all reached at step 1 (1000 tokens), then 2154 at step 3
    assert kept_steps({"log_tokens": {"start": 1, "per_decade": 3}}, 3, 1000) == [1, 3]
    assert [log_marks(t, 1000, 2) for t in (999, 1000, 3162, 3163, 10_000)] == [0, 1, 1, 2, 3]
    assert keep_config(None) is None and keep_config({"every_n_steps": None}) is None  # keeps nothing


@pytest.mark.parametrize("override,message", [
    ("callbacks.checkpoint.keep.every_n_steps=0",
     "callbacks.checkpoint.keep.every_n_steps=0 is not allowed; allowed: an integer >= 1 or null"),
    ("callbacks.checkpoint.keep.log_tokens.start=0",
     "callbacks.checkpoint.keep.log_tokens.start=0.0 is not allowed; allowed: a number > 0 or null"),
    ("callbacks.checkpoint.keep.log_tokens.per_decade=0",
     "callbacks.checkpoint.keep.log_tokens.per_decade=0 is not allowed; allowed: an integer >= 1"),
    ("+callbacks.checkpoint.keep.every=5",
     "callbacks.checkpoint.keep.every is not an option of callbacks.checkpoint.keep; allowed: every_n_steps, "
     "log_tokens, weights_only"),
    ("+callbacks.checkpoint.keep.log_tokens.strat=5", "callbacks.checkpoint.keep.log_tokens.strat is not an option of "
                                                      "callbacks.checkpoint.keep.log_tokens (did you mean "),
])
def test_a_bad_schedule_is_one_line_before_training(override, message):
    with pytest.raises(UserError) as err:
        validate_config(compose([override]))
    assert_one_line_error(err, starts=message)


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_kept_checkpoints_beside_last_and_a_resume(corpus, tmp_path):
    """6 steps, last.ckpt every 4, kept every 2 steps and at 128 * 10^(j/2) tokens; then a resume to step 8 with
    ckpt_path=auto starts from last.ckpt (step 4), not from the newer kept step 6, and keeps steps 6 and 8."""
    out = tmp_path / "run"
    keep = ["callbacks.checkpoint.keep.every_n_steps=2", f"callbacks.checkpoint.keep.log_tokens.start={PER_STEP}",
            "callbacks.checkpoint.keep.log_tokens.per_decade=2"]
    base = [f"paths.output_dir={out}", *small(corpus), "callbacks.checkpoint.every_n_train_steps=4", *keep]
    run_cli("sinklab-train", *base, "trainer.max_steps=6", check=True)
    kept = kept_checkpoints(out)
    assert [(s, t) for s, t, _ in kept] == [(s, s * PER_STEP) for s in (1, 2, 4, 6)]  # marks at 128, 405, 1280
    assert [p.name for _, _, p in kept][:2] == ["step0000001-tokens128.ckpt", "step0000002-tokens256.ckpt"]
    for step, tokens, path in kept:
        ckpt = read_checkpoint(path)
        assert (ckpt["global_step"], ckpt[TOKENS_SEEN]) == (step, tokens)
        assert "optimizer_states" not in ckpt  # weights only
    with pytest.raises(UserError, match="cannot resume training"):
        read_training_checkpoint(kept[-1][2])
    last = read_checkpoint(out / "checkpoints" / "last.ckpt")
    assert (last["global_step"], last[TOKENS_SEEN]) == (4, 4 * PER_STEP) and "optimizer_states" in last
    # ModelCheckpoint's state key: runs checkpointed before the kept schedule existed resume with their state
    assert any(key.startswith("ModelCheckpoint{") for key in last["callbacks"])
    first_at_6 = load_model(kept[-1][2]).state_dict()
    assert not all(torch.equal(v, first_at_6[k]) for k, v in load_model(kept[-2][2]).state_dict().items())

    run_cli("sinklab-train", *base, "trainer.max_steps=8", "ckpt_path=auto", check=True)
    kept = kept_checkpoints(out)
    assert [s for s, _, _ in kept] == [1, 2, 4, 6, 8]
    assert read_checkpoint(out / "checkpoints" / "last.ckpt")["global_step"] == 8
    again_at_6 = load_model(kept[3][2]).state_dict()  # written by the resumed run, from step 4 on
    for k, v in first_at_6.items():
        torch.testing.assert_close(again_at_6[k], v, rtol=1e-5, atol=1e-6)
