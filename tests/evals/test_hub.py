"""--hf-model with a hub id and --revision, without a network: a huggingface_hub cache layout built in the test's temp
dir (blobs, snapshots/<commit>, refs/<branch>) holding two revisions of a tiny model, read with HF_HUB_OFFLINE=1;
--dtype; the one-line refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from sinklab.analysis.probe_inputs import make_tokens
from tests.helpers import assert_one_line_error, hub_cache, run_cli, tiny_hf

REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The cache (main: weights of seed 0; step1000: seed 1), the two saved dirs and the commits."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hub")
    dirs = {"main": tiny_hf("llama", root / "main", seed=0), "step1000": tiny_hf("llama", root / "step1000", seed=1)}
    return root / "cache", dirs, hub_cache(root / "cache", REPO_ID, dirs)


@pytest.fixture
def offline_cache(hub, monkeypatch):
    """huggingface_hub reading the test's cache offline (its constants are read at import: set them here too)."""
    from huggingface_hub import constants

    cache = hub[0]
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def alpha_of(capsys, *args: str) -> tuple[dict, np.ndarray]:
    rc, out, err = run_cli("sinklab", "measure", *args, "--input", "random", "--num-seqs", "3", "--seq-len", "16",
                           "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    return res, np.array(res["alpha"])


def test_revisions_resolve_through_refs_and_commits(offline_cache, capsys):
    from sinklab.targets.hub_models import resolve_model

    cache, dirs, commits = offline_cache
    snapshots = cache / "models--tiny-org--tiny-llama" / "snapshots"
    assert resolve_model(REPO_ID) == snapshots / commits["main"]  # no revision: refs/main
    assert resolve_model(REPO_ID, "step1000") == snapshots / commits["step1000"]  # a branch through refs/
    assert resolve_model(REPO_ID, commits["step1000"]) == snapshots / commits["step1000"]  # a commit
    main, a_main = alpha_of(capsys, "--hf-model", REPO_ID)
    step, a_step = alpha_of(capsys, "--hf-model", REPO_ID, "--revision", "step1000")
    _, a_commit = alpha_of(capsys, "--hf-model", REPO_ID, "--revision", commits["step1000"])
    assert (main["target"], main["revision"], step["revision"]) == (REPO_ID, None, "step1000")
    assert np.abs(a_main - a_step).max() > 1e-3  # different weights, different numbers
    np.testing.assert_array_equal(a_step, a_commit)
    # each revision is the weights saved for it: the eager maps of that dir
    import transformers

    for name, alpha in (("main", a_main), ("step1000", a_step)):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(dirs[name]), attn_implementation="eager")
        with torch.no_grad():
            maps = torch.stack(model.eval()(input_ids=make_tokens("random", 3, 16, 128, 0),
                                            output_attentions=True).attentions, 1)
        np.testing.assert_allclose(alpha, maps[..., :, 0].mean(-1).mean(0).numpy(), atol=1e-5)


def test_offline_and_not_cached_is_one_line_with_the_fetch_command(offline_cache, capsys):
    cases = [(("--hf-model", REPO_ID, "--revision", "v2"), ["tiny-org/tiny-llama", "v2",
                                                             "hf download tiny-org/tiny-llama --revision v2"]),
             (("--hf-model", "tiny-org/absent"),
              ["tiny-org/absent", "HF_HUB_OFFLINE=1", "hf download tiny-org/absent"]),
             (("--hf-model", "no/such/dir"), ["--hf-model no/such/dir: no such directory, and not a hub id"]),
             (("--hf-model", str(offline_cache[1]["main"]), "--revision", "main"),
              ["--revision main", "local directory"]),
             (("--hf-model", REPO_ID, "--dtype", "int8"), ["--dtype", "'float32', 'bfloat16', 'float16'"])]
    for args, named in cases:
        rc, out, err = run_cli("sinklab", "measure", *args, "--input", "random", capsys=capsys)
        assert rc == 2 and out == "", (args, err)
        assert_one_line_error(err, *named)


@pytest.mark.slow
@pytest.mark.ci
def test_the_command_line_reads_the_cache_named_by_hf_hub_cache(hub):
    """As a user runs it: a fresh process with HF_HUB_CACHE and HF_HUB_OFFLINE=1 in its environment."""
    cache, _, commits = hub
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = run_cli("sinklab", "measure", "--hf-model", REPO_ID, "--revision", "step1000", "--input", "repeat",
                   "--num-seqs", "2", "--json", process=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (json.loads(proc.stdout)["revision"], json.loads(proc.stdout)["input"]) == ("step1000", "repeat")


def test_dtype_bfloat16_measures_close_to_float32(offline_cache, capsys):
    f32, a32 = alpha_of(capsys, "--hf-model", REPO_ID, "--dtype", "float32")
    bf16, a16 = alpha_of(capsys, "--hf-model", REPO_ID, "--dtype", "bfloat16")
    assert (f32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    np.testing.assert_allclose(a16, a32, atol=2e-2)  # bf16 keeps ~3 significant digits of each map entry
    assert np.abs(a16 - a32).max() > 0  # it did run in bfloat16


def test_a_trajectory_over_hub_revisions(offline_cache, capsys, tmp_path):
    """`sinklab trajectory --hf-model ID --revision R1 R2`: one row per revision, read from the cache offline, its
    step parsed from the name, and each row's numbers those `sinklab measure` gives that revision."""
    import pandas as pd

    csv, plot = tmp_path / "t.csv", tmp_path / "t.png"
    rc, out, err = run_cli("sinklab", "trajectory", "--hf-model", REPO_ID, "--revision", "step1000", "main", "--input",
                           "random", "--num-seqs", "3", "--seq-len", "16", "--metrics", "sink/alpha1", "--csv",
                           str(csv), "--plot", str(plot), capsys=capsys)
    assert rc == 0, err
    rows = pd.read_csv(csv).set_index("checkpoint")
    assert set(rows.index) == {"step1000", "main"} and rows.loc["step1000", "step"] == 1000 and plot.is_file()
    for rev in ("step1000", "main"):
        res, alpha = alpha_of(capsys, "--hf-model", REPO_ID, "--revision", rev)
        assert rows.loc[rev, "sink/alpha1"] == pytest.approx(alpha.mean(), rel=1e-5)  # alpha_1 (L, H)
