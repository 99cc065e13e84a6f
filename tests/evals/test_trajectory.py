"""sinklab trajectory: a run's kept checkpoints measured again equal what the training callback logged at those steps,
a metric added after training is measured on every checkpoint, local transformers checkpoint dirs against their eager
maps, revision names, the documentation's commands and one-line errors."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from sinklab.runs.checkpoints import load_model
from sinklab.cli.trajectory import build_parser, check_args, metric_keys
from sinklab.errors import UserError
from sinklab.keys import UNIT
from sinklab.metrics import METRICS, Metric, attention_maps
from sinklab.runs.run_data import probe_tokens
from sinklab.analysis.trajectories import hf_series, parse_revision
from tests.helpers import assert_one_line_error, readme_cli_lines, run_cli, series

TOKENS_PER_STEP = 16 * 64  # FAST: 16 blocks of 64 tokens per step


def trajectory(capsys, tmp_path, *args: str) -> tuple[dict, pd.DataFrame]:
    """`sinklab trajectory ARGS --json` in this process: (its JSON, its CSV)."""
    csv, png = tmp_path / "t.csv", tmp_path / "t.png"
    rc, out, err = run_cli("sinklab", "trajectory", *args, "--csv", str(csv), "--plot", str(png), "--json",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert png.stat().st_size > 10_000 and res["plot"] == str(png)
    return res, pd.read_csv(csv)


# ------------------------------------------------------------------------------------------------ sinklab runs
def test_kept_checkpoints_measured_again_equal_what_the_callback_logged(trained_run, capsys, tmp_path):
    """The acceptance check: Sink_1 (and alpha_1, entropy, the RoPE heads' Sink_1 and q / k maxima) of each kept
    checkpoint, measured by `sinklab trajectory` on the run's probe set, equal the training callback's values logged
    at that step."""
    res, table = trajectory(capsys, tmp_path, str(trained_run), "--batch-size", "50", "--metrics",
                            "sink/sink1,sink/alpha1", "entropy", "heads")
    heads = ["heads/rope/sink1", "heads/rope/qk_max_partial_cycle"]  # the headline keys of the types it has
    assert res["metrics"] == ["sink/sink1", "sink/alpha1", "act/attn_entropy", *heads]
    assert "heads/nope/sink1" in res["not_measured"] and "heads/rope/qk_max_unrotated" in res["not_measured"]
    assert list(table["step"]) == [16, 29, 40, 51, 80, 90, 120]  # kept (log-spaced and every 40); last.ckpt is 120
    assert list(table["tokens"]) == [s * TOKENS_PER_STEP for s in table["step"]]
    assert set(table["input"]) == {"natural 100x64"} and res["x"] == "tokens"
    metrics_csv = trained_run / "metrics.csv"
    compared = 0
    for key in ("sink/sink1", "sink/alpha1", "act/attn_entropy", *heads):
        logged = {step: float(v) for step, v in series(metrics_csv, key).items()}
        for step, value in zip(table["step"], table[key]):
            if step in logged:
                assert value == pytest.approx(logged[step], rel=1e-5, abs=1e-6), (key, step)
                compared += 1
    assert compared == 5 * 3  # steps 40, 80, 120
    assert max(series(metrics_csv, "sink/alpha1")) == 120 and table["sink/alpha1"].nunique() == len(table)


@pytest.fixture
def row_max_metric(monkeypatch):
    """A metric registered after the run was trained: the mean over queries, heads and layers of a row's largest
    attention weight (act/attn_row_max)."""

    class RowMax(Metric):
        records = frozenset({"maps"})
        bounds = ((r"^act/attn_row_max$", UNIT),)
        headline = ("act/attn_row_max",)

        def __init__(self, ctx):
            super().__init__(ctx)
            self.total, self.count = 0.0, 0

        def update_maps(self, layer, rows, maps):
            self.total += maps.amax(-1).double().sum().item()  # (B, H, R, T) -> (B, H, R)
            self.count += maps[..., 0].numel()

        def result(self):
            return {"mean": self.total / self.count}

        @staticmethod
        def flatten(result):
            return {"act/attn_row_max": result["mean"]}

    RowMax.name = "attn_row_max"
    monkeypatch.setitem(METRICS._classes, "attn_row_max", RowMax)
    return RowMax


def test_a_new_metric_is_measured_on_every_kept_checkpoint_without_retraining(trained_run, row_max_metric, capsys,
                                                                              tmp_path):
    assert "act/attn_row_max" not in (trained_run / "metrics.csv").read_text()  # the callback never logged it
    res, table = trajectory(capsys, tmp_path, str(trained_run), "--metrics", "attn_row_max", "--num-seqs", "20")
    assert res["metrics"] == ["act/attn_row_max"]
    tokens = probe_tokens(trained_run, 20, None)
    for path, value in zip(table["checkpoint"], table["act/attn_row_max"]):
        with torch.no_grad():
            maps = attention_maps(load_model(path), tokens)  # every layer's (N, H, T, T)
        direct = torch.stack([m.amax(-1).mean() for m in maps]).mean().item()
        assert value == pytest.approx(direct, rel=1e-5)
    assert table["act/attn_row_max"].nunique() == len(table)


def test_two_runs_on_one_figure_and_the_text_table(trained_run, capsys, tmp_path):
    rc, out, err = run_cli("sinklab", "trajectory", str(trained_run), str(trained_run), "--input", "random",
                           "--num-seqs", "8", "--csv", str(tmp_path / "a.csv"), "--plot", str(tmp_path / "a.png"),
                           capsys=capsys)
    assert rc == 0, err
    assert f"{trained_run} (input random 8x64)" in out and f"{trained_run} (2) (input random 8x64)" in out
    assert "measured 14 checkpoints" in out
    table = pd.read_csv(tmp_path / "a.csv")
    assert len(table) == 14 and set(table["input"]) == {"random 8x64"}
    assert table.groupby("series")["step"].apply(list).tolist() == [[16, 29, 40, 51, 80, 90, 120]] * 2


# ------------------------------------------------------------------------------------------------ transformers
def tiny_neox(path: Path, seed: int, tokenizer) -> Path:
    """A random 2-layer GPT-NeoX with partial rotary (the Pythia family), its first layer sharpened, and a tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5)
    model = transformers.GPTNeoXForCausalLM(cfg)
    with torch.no_grad():
        model.gpt_neox.layers[0].attention.query_key_value.weight.mul_(8.0)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """Two local checkpoint dirs of one (random) GPT-NeoX training, step100 and step200, with a word-level
    tokenizer, and a text file."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("hf_traj")
    words = [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    rng = np.random.default_rng(0)
    (d / "text.txt").write_text(" ".join(rng.choice(words, 400)))
    dirs = [tiny_neox(d / "train" / f"step{s}", seed, fast) for seed, s in enumerate((100, 200))]
    return d, dirs, fast


def test_local_transformers_checkpoints_against_their_eager_maps(hf_checkpoints, capsys, tmp_path):
    d, dirs, tokenizer = hf_checkpoints
    res, table = trajectory(capsys, tmp_path, "--hf-model", *map(str, dirs), "--text", str(d / "text.txt"),
                            "--num-seqs", "6", "--seq-len", "16", "--tokens-per-step", "1000", "--metrics",
                            "sink/alpha1", "entropy")
    assert list(table["step"]) == [100, 200] and list(table["tokens"]) == [100_000, 200_000]
    assert set(table["input"]) == {"text 6x16"}
    ids = tokenizer(" ".join((d / "text.txt").read_text().split()), add_special_tokens=False)["input_ids"]
    tokens = torch.tensor(ids[:96]).view(6, 16)
    transformers = pytest.importorskip("transformers")
    for path, alpha1, entropy in zip(dirs, table["sink/alpha1"], table["act/attn_entropy"]):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
        with torch.no_grad():
            maps = torch.stack(model(tokens, output_attentions=True).attentions)  # (L, N, H, T, T)
        assert alpha1 == pytest.approx(maps[..., 0].mean().item(), rel=1e-5)
        assert entropy == pytest.approx((-torch.special.xlogy(maps, maps).sum(-1)).mean().item(), rel=1e-5)
    assert table["sink/alpha1"].nunique() == 2


@pytest.mark.parametrize("name,tokens_per_step,expected", [
    ("step143000", None, (143000, None)),
    ("step143000", 2_097_152, (143000, 143000 * 2_097_152)),
    ("stage1-step1000-tokens4B", None, (1000, 4_000_000_000)),
    ("step20000-tokens84B", 5, (20000, 84_000_000_000)),
    ("stage2-ingredient1-step11931-tokens50B", None, (11931, 50_000_000_000)),
    ("out/checkpoint-500", 10, (500, 5000)),
    ("tokens2.5M", None, (None, 2_500_000)),
    ("main", 10, (None, None)),
    ("v1.0-steps", None, (None, None)),
])
def test_revision_names_give_step_and_tokens(name, tokens_per_step, expected):
    assert parse_revision(name, tokens_per_step) == expected


def test_pythia_revisions_are_placed_by_its_tokens_per_step():
    s = hf_series(["EleutherAI/pythia-160m"], ["step1000", "main"], None)
    assert [(p.step, p.tokens, p.revision) for p in s.points] == [(1000, 1000 * 2_097_152, "step1000"),
                                                                  (None, None, "main")]
    assert [p.tokens for p in hf_series(["org/other"], ["step10"], None).points] == [None]


# ------------------------------------------------------------------------------------------------ documentation, errors
def test_readme_trajectory_commands(trained_run, capsys, tmp_path, monkeypatch):
    """The docs' `sinklab trajectory` lines: on local runs they run (runs/a and runs/b: the trained run); a hub
    model's line is parsed and its revisions placed (no network here); the line reading an export's revisions
    (hf/a) is run by the next test."""
    monkeypatch.chdir(tmp_path)
    commands = readme_cli_lines("sinklab trajectory", {"runs/a": trained_run, "runs/b": trained_run})
    assert len(commands) >= 3
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        check_args(args)
        metric_keys(args.metrics)
        if args.hf_groups:
            (names, revisions), = args.hf_groups
            if names == ["hf/a"]:
                continue
            assert names == ["EleutherAI/pythia-160m"] and len(revisions) >= 4
            assert all(p.tokens == p.step * 2_097_152 for p in hf_series(names, revisions, None).points)
            continue
        rc, out, err = run_cli("sinklab", *argv, "--num-seqs", "10", capsys=capsys)
        assert rc == 0, (argv, err)
        assert args.csv.is_file() and args.plot.is_file() and "measured" in out
        assert len(pd.read_csv(args.csv)) == 7 * len(args.runs)


def test_the_documented_measure_commands_run(trained_run, capsys, monkeypatch, tmp_path):
    """The documentation's `sinklab measure` lines on a run (the README's first command among them), on the trained
    run and its last.ckpt, on 10 probe sequences instead of 100: the run's probe set (natural text) or random tokens,
    at every eps and for the first k tokens the line asks."""
    monkeypatch.chdir(tmp_path)
    commands = readme_cli_lines("sinklab measure runs/a", {"runs/a": trained_run,
                                                           "runs/a/checkpoints/last.ckpt": trained_run / "checkpoints"
                                                           / "last.ckpt"})
    assert len(commands) >= 2 and any("--json" in c for c in commands)
    for argv in commands:
        json_out = "--json" in argv
        rc, out, err = run_cli("sinklab", *argv, "--num-seqs", "10", *([] if json_out else ["--json"]), capsys=capsys)
        assert rc == 0, (argv, err)
        res = json.loads(out)
        assert res["num_seqs"] == 10 and res["input"] == ("random" if "random" in argv else "natural"), argv
        k = int(argv[argv.index("--k") + 1]) if "--k" in argv else None
        eps = [float(e) for e in argv[argv.index("--eps") + 1:argv.index("--eps") + 3]] if "--eps" in argv else None
        if k is not None:
            assert sorted(res["sink"], key=int) == [str(j) for j in range(1, k + 1)]
        if eps is not None:
            assert res["eps"] == eps


def test_the_readme_revisions_export_is_measured_as_the_run(trained_run, capsys, tmp_path, monkeypatch):
    """The docs' `sinklab export-hf runs/a hf/a --revisions`: the trained run's kept checkpoints and last.ckpt as
    branches step<N> of one git repository, main at last.ckpt's, each branch's weights (transformers'
    LlamaForCausalLM from a checkout) its checkpoint's; and its `sinklab trajectory --hf-model hf/a --revision ...`
    line gives each step the step, tokens and values that `sinklab trajectory runs/a` gives on the same input."""
    transformers = pytest.importorskip("transformers")
    from sinklab.export.llama import llama_state_dict
    from tests.helpers import git_checkout

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "hf_a"
    paths = {"runs/a": trained_run, "hf/a": out}
    (export_line,) = readme_cli_lines("sinklab export-hf runs/a hf/a --revisions", paths)
    rc, printed, err = run_cli("sinklab", *export_line, capsys=capsys)
    assert rc == 0, err
    assert "(LlamaForCausalLM, 2 layers" in printed and "tokenizer: from " in printed
    steps = [16, 29, 40, 51, 80, 90, 120]
    git = ["git", "-C", str(out)]
    refs = subprocess.run([*git, "for-each-ref", "--format=%(refname:short) %(objectname)", "refs/heads"],
                          capture_output=True, text=True, check=True).stdout.split("\n")
    refs = dict(line.split() for line in refs if line)
    assert sorted(refs) == sorted(["main", *(f"step{s}" for s in steps)]) and refs["main"] == refs["step120"]
    for step, ckpt in ((16, trained_run / "checkpoints" / "kept" / "step0000016-tokens16384.ckpt"),
                       (120, trained_run / "checkpoints" / "last.ckpt")):
        d = git_checkout(out, f"step{step}", tmp_path / f"step{step}")
        assert (d / "tokenizer.json").is_file() and (d / "README.md").is_file()
        assert json.loads((d / "trainer_state.json").read_text()) == {"global_step": step,
                                                                       "num_input_tokens_seen": step * TOKENS_PER_STEP}
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(d)).state_dict()
        model = load_model(ckpt)
        expected = llama_state_dict(model.state_dict(), model.cfg.n_layer)
        assert hf.keys() == expected.keys() and all(torch.equal(hf[k], v) for k, v in expected.items()), step

    (line,) = readme_cli_lines("sinklab trajectory --hf-model hf/a", paths)
    metrics = ["--num-seqs", "10", "--metrics", "sink/sink1,sink/alpha1,entropy"]
    theirs, _ = trajectory(capsys, tmp_path, *line[1:], *metrics)
    ours, _ = trajectory(capsys, tmp_path, str(trained_run), "--input", "random", *metrics)
    by_step = {p["step"]: p for p in ours["points"]}
    assert [p["step"] for p in theirs["points"]] == [16, 29, 51, 90]
    assert len({p["values"]["sink/alpha1"] for p in theirs["points"]}) == 4  # four models, four values
    for p in theirs["points"]:
        assert p["tokens"] == by_step[p["step"]]["tokens"] == p["step"] * TOKENS_PER_STEP
        for key, value in by_step[p["step"]]["values"].items():
            assert p["values"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (p["step"], key)


@pytest.mark.parametrize("args,message", [
    ([], "nothing to measure"),
    (["--revision", "step1"], "--revision needs an --hf-model"),
    (["--hf-model", "a", "b", "--revision", "step1", "--input", "random"], "one --hf-model ID per --revision list"),
    (["RUN", "--metrics", "act/nonsense"], "--metrics act/nonsense: no registered metric logs it; allowed: a metric"),
    (["RUN", "--text", "t.txt"], "--text applies to --hf-model models"),
    (["RUN", "--num-seqs", "0"], "--num-seqs 0 must be a positive integer"),
    (["NOT_A_RUN"], "not a training run dir"),
    (["--hf-model", "NOT_A_DIR", "--input", "random"], "NOT_A_DIR"),
    (["--hf-model", "some/model", "--revision", "step1"], "--hf-model has no probe set; choose its input: --text"),
])
def test_bad_input_is_one_line_and_exit_2(small_run, capsys, tmp_path, args, message):
    run, _, _ = small_run
    argv = [str(run) if a == "RUN" else str(tmp_path / a) if a == "NOT_A_RUN" else a for a in args]
    rc, out, err = run_cli("sinklab", "trajectory", *argv, "--csv", str(tmp_path / "t.csv"), capsys=capsys)
    assert rc == 2 and out == "", err
    assert_one_line_error(err, message)
    assert not (tmp_path / "t.csv").exists()


def test_a_run_without_checkpoints_is_refused(small_run, tmp_path):
    from sinklab.analysis.trajectories import run_series

    run, _, _ = small_run
    bare = tmp_path / "bare"
    (bare / ".hydra").mkdir(parents=True)
    (bare / ".hydra" / "config.yaml").write_text((run / ".hydra" / "config.yaml").read_text())
    with pytest.raises(UserError, match="no checkpoints .* callbacks.checkpoint.keep.every_n_steps"):
        run_series(str(bare))
    assert [p.step for p in run_series(str(run)).points] == [None]  # last.ckpt only, written outside training
