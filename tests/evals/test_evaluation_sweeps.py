"""`sinklab eval NAME --sweep SWEEP_DIR`: a registered evaluation (sinklab.evals.registry) over every finished job of a
sweep, in this process, into JOB/NAME.json and SWEEP_DIR/NAME.csv; `sinklab report` reads that CSV of every registered
evaluation, a throwaway one registered here too, within the bounds it declares."""
from __future__ import annotations

import csv
import importlib
import json
import shutil
import textwrap

import pandas as pd
import pytest

from sinklab.config.claims import parse_claims
from sinklab.errors import UserError
from sinklab.evals import EVALUATIONS, Evaluation
from sinklab.evals.registry import NON_NEGATIVE, UNIT
from sinklab.io import stale_temporaries
from sinklab.report import build_report
from tests.helpers import run_cli
from tests.helpers.sweeps import base_config, write_hydra, write_metrics


def numeric(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.fixture
def sweep(tmp_path, small_run):
    """A two-job sweep: the shared small run as job 0 (seed=0), job 1 without a checkpoint (not finished)."""
    run, _, _ = small_run
    sweep = tmp_path / "sweep"
    shutil.copytree(run, sweep / "0")
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- seed=0\n")
    (sweep / "1" / ".hydra").mkdir(parents=True)
    return sweep


def test_streaming_and_intervene_sweeps_write_each_jobs_json_and_one_csv(capsys, sweep):
    """streaming.csv and intervene.csv hold each finished job's overrides and its JSON's numbers, the columns their
    evaluations declare; the unfinished job is skipped with a line on stderr (not with --jobs 0, which leaves it
    out); the JSON is what `--json` prints for the job."""
    for kind, options in (("streaming", ["--n-tokens", "200", "--first", "0,1", "--recent", "8",
                                         "--baselines", "recompute"]),
                          ("intervene", ["--val-batches", "1", "--interventions", "mask_first", "--per-layer",
                                         "--per-head", "--jobs", "0"])):
        rc, out, err = run_cli("sinklab", "eval", kind, "--sweep", str(sweep), *options)
        assert rc == 0, err
        assert (f"{sweep / '1'}: no checkpoints/last.ckpt" in err) == (kind == "streaming"), err
        assert out.splitlines()[-1] == f"wrote {sweep / kind}.csv (1 job)", out
        assert not stale_temporaries(sweep / "0" / f"{kind}.json") and not (sweep / "1" / f"{kind}.json").exists()
        (row,) = pd.read_csv(sweep / f"{kind}.csv", dtype={"job": str}).to_dict("records")
        res = json.loads((sweep / "0" / f"{kind}.json").read_text())
        assert row["job"] == "0" and row["seed"] == 0
        if kind == "streaming":
            assert [s["kind"] for s in res["settings"]] == ["streaming", "streaming", "recompute"]
            for s, column in zip(res["settings"], ("x0_y8", "x1_y8", "recompute")):
                assert row[f"{column}_ppl"] == pytest.approx(s["ppl"]) and row[f"{column}_keys"] == s["keys"]
            assert row["n_tokens"] == res["n_tokens"] == 200
        else:
            assert row["massive_layer"] == res["massive"]["layer"]  # 0-based, as every layer number
            assert (row["massive_token"], row["massive_ratio"]) == (res["massive"]["token"],
                                                                    pytest.approx(res["massive"]["ratio"]))
            for name in ("none", "mask_first"):
                for key in ("ppl", "dppl", "sink1", "alpha1"):
                    assert row[f"{name}_{key}"] == pytest.approx(res["rows"][name][key])
            assert not any(c.endswith("_loss") for c in row)
            for r in res["per_layer"]["mask_first"]:  # --per-layer: each layer's; --per-head: the correlation
                assert row[f"layer{r['layer']}_mask_first_dppl"] == pytest.approx(r["dppl"])
            assert row["per_head_spearman"] == pytest.approx(res["per_head"]["spearman_alpha1_dppl"])
        # every column it writes is one its evaluation declares, with the physical range the value lies in
        evaluation = EVALUATIONS.get(kind)
        for column, value in numeric({k: v for k, v in row.items() if k not in ("job", "seed")}).items():
            lo, hi = evaluation.column_bounds(column) or pytest.fail(f"{kind}: {column} has no bounds")
            assert lo <= value <= hi, (kind, column, value)
        # the same job run alone prints the JSON the sweep wrote (but for its timings)
        rc, out, err = run_cli("sinklab", "eval", kind, str(sweep / "0"), "--json",
                                   *[a for a in options if a not in ("--jobs", "0")])
        alone = json.loads(out)
        assert rc == 0 and evaluation.row(alone) == pytest.approx(evaluation.row(res)), err


@pytest.mark.parametrize("args, message", [
    (["--sweep", "{tmp}/NOT_A_DIR"], "SWEEP_DIR {tmp}/NOT_A_DIR is not a directory"),
    (["--sweep", "{tmp}"], "SWEEP_DIR {tmp} has no job dirs (0, 1, ..."),
    (["--sweep", "{sweep}", "--jobs", "1"], "SWEEP_DIR {sweep}: no job dir of 1 has checkpoints/last.ckpt"),
    (["--sweep", "{sweep}", "--jobs", "7"], "job 7 is not a job dir of {sweep}; allowed: 0, 1"),
    (["{sweep}/0", "--sweep", "{sweep}"], "pass either --sweep SWEEP_DIR or one model (TARGET, --hf-model), not both"),
    (["{sweep}/0", "--jobs", "0"], "--jobs 0: goes with --sweep SWEEP_DIR"),
])
def test_sweep_errors_are_one_line_before_any_work(capsys, tmp_path, sweep, args, message):
    where = {"tmp": tmp_path, "sweep": sweep}
    rc, out, err = run_cli("sinklab", "eval", "streaming", *[a.format(**where) for a in args])
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("sinklab eval streaming: error: ") and message.format(**where) in err, err
    assert not list(sweep.glob("*/streaming.json")) and not (sweep / "streaming.csv").exists()


def test_a_job_result_that_is_not_the_evaluations_is_one_line(tmp_path):
    from sinklab.evals.registry import write_table

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "streaming.json").write_text('{"settings": []}\n')
    with pytest.raises(UserError) as err:
        write_table(EVALUATIONS.get("streaming"), tmp_path)
    assert f"{tmp_path / '0' / 'streaming.json'} is not a result of `sinklab eval streaming` (KeyError" in str(err.value)
    assert "\n" not in str(err.value)


def test_every_evaluation_command_sweeps_as_its_registered_name():
    """The registry names each evaluation's command; the command's parser names the evaluation its --sweep writes."""
    assert {"quant", "streaming", "intervene"} <= set(EVALUATIONS.names())
    for evaluation in EVALUATIONS:
        parser = importlib.import_module(evaluation.command).build_parser()
        assert parser.get_default("evaluation") == evaluation.name, evaluation.command


def test_claims_on_evaluation_columns_are_checked_against_the_registry():
    def claim(metric: str) -> dict:
        return {"baseline": {"model/gate": "none"}, "claims": [{"id": "a", "setting": {"model/gate": "elementwise"},
                                                                 "metric": metric, "direction": "lower"}]}

    for metric in ("quant/w4a4_gap", "streaming/x0_y60_ppl", "intervene/mask_first_dppl", "sink/sink1", "val/loss"):
        assert parse_claims(claim(metric), EVALUATIONS)[1][0].metric == metric
    with pytest.raises(UserError) as err:
        parse_claims(claim("quant/w4a4_gpa"), EVALUATIONS)
    assert str(err.value).startswith("experiment.claims[0] (a).metric='quant/w4a4_gpa' is not allowed; allowed: a "
                                     "column of the quant evaluation: quant/<a name matching ")


# ------------------------------------------------------------------------------------- a new evaluation, no list
COMMAND = '''
"""`sinklab eval share`: a throwaway evaluation: the number in JOB/share.txt and the share it is of 100."""
from pathlib import Path

from sinklab.cli.base import OneLineParser, add_sweep_args, command_main


def build_parser():
    ap = OneLineParser(prog="sinklab eval share")
    ap.add_argument("target", nargs="?")
    ap.add_argument("--hf-model", default=None)
    ap.add_argument("--json", action="store_true")
    add_sweep_args(ap, "share")
    return ap


def run(args):
    count = float((Path(args.target) / "share.txt").read_text())
    return {"count": count, "share": count / 100}


def main(argv=None):
    return command_main("sinklab eval share", build_parser(), run, str, argv)
'''


@pytest.fixture
def share_evaluation(tmp_path, monkeypatch):
    """An evaluation `share` registered for this test only, its command a module on sys.path."""
    (tmp_path / "share_command.py").write_text(textwrap.dedent(COMMAND))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(EVALUATIONS, "_classes", dict(EVALUATIONS._classes))

    @EVALUATIONS.register("share")
    class Share(Evaluation):
        command = "share_command"
        summary = "the number in share.txt"
        bounds = ((r"^count$", NON_NEGATIVE), (r"^share$", UNIT))

        @staticmethod
        def row(result):
            return {"count": result["count"], "share": result["share"]}

    return Share


def test_a_registered_evaluation_reaches_the_report_within_its_bounds(capsys, tmp_path, share_evaluation):
    """`sinklab eval share --sweep` writes share.csv and `sinklab report` reads its columns as share/count and
    share/share; a share above 1 is outside the bounds `share` declares and is left out, with a warning, as a value
    outside its range in metrics.csv is. No list was edited: the registration is all."""
    sweep = tmp_path / "sweep"
    for job, count in enumerate((40.0, 250.0)):
        d = sweep / str(job)
        write_hydra(d, base_config(wd=0.1 * (job + 1)), [f"optim.weight_decay={0.1 * (job + 1)}"])
        write_metrics(d / "metrics.csv", 100, lambda s: 50.0, lambda s: 3.0)
        (d / "status.json").write_text(json.dumps({"status": "completed", "step": 100}))
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / "last.ckpt").write_bytes(b"")  # finished: what --sweep looks for
        (d / "share.txt").write_text(str(count))
    rc, out, err = run_cli("sinklab", "eval", "--help")
    assert rc == 0 and "share" in out and "the number in share.txt" in out
    rc, out, err = run_cli("sinklab", "eval", "share", "--sweep", str(sweep))
    assert rc == 0 and out.splitlines()[-1] == f"wrote {sweep / 'share.csv'} (2 jobs)", (out, err)
    table = pd.read_csv(sweep / "share.csv", dtype={"job": str})
    assert list(table.columns) == ["job", "optim.weight_decay", "count", "share"]
    assert list(table["share"]) == [0.4, 2.5]

    rows = build_report(sweep, metrics=["share/count", "share/share"])["rows"]
    assert [r["share/count"] for r in rows] == [40.0, 250.0]
    assert [r["share/share"] for r in rows] == [0.4, None]  # 2.5 is outside [0, 1]
    assert parse_claims({"baseline": {"optim.weight_decay": 0.1}, "claims": [
        {"id": "s", "setting": {"optim.weight_decay": 0.2}, "metric": "share/share", "direction": "higher"}]}, EVALUATIONS)
    with pytest.raises(UserError, match="share/ratio"):
        parse_claims({"baseline": {"optim.weight_decay": 0.1}, "claims": [
            {"id": "s", "setting": {"optim.weight_decay": 0.2}, "metric": "share/ratio", "direction": "higher"}]}, EVALUATIONS)


def test_a_rerun_merges_into_the_jobs_earlier_result_or_keeps_it_apart(capsys, sweep):
    """Nothing a sweep evaluation wrote is lost when it runs again on the job: a rerun on the same checkpoint and text
    adds its settings to the job's JSON (replacing those of the same name, keeping the others, and the CSV has
    both); with other data, or after the checkpoint changed, the earlier JSON is kept as streaming.K.json."""
    import os

    job = sweep / "0"

    def streaming(first: str, n_tokens: str = "200") -> tuple[str, dict]:
        rc, out, err = run_cli("sinklab", "eval", "streaming", "--sweep", str(sweep), "--jobs", "0", "--n-tokens",
                               n_tokens, "--first", first, "--recent", "8", "--baselines", "none")
        assert rc == 0, err
        return err, json.loads((job / "streaming.json").read_text())

    _, first = streaming("0")
    err, both = streaming("1")
    assert "streaming.json: merged with the earlier result (1 setting of it kept)" in err, err
    assert [s["name"] for s in both["settings"]] == ["x=0 y=8", "x=1 y=8"]
    assert both["settings"][0] == first["settings"][0] and both["checkpoint"] == first["checkpoint"]
    (row,) = pd.read_csv(sweep / "streaming.csv").to_dict("records")
    assert row["x0_y8_ppl"] == pytest.approx(first["settings"][0]["ppl"])
    assert row["x1_y8_ppl"] == pytest.approx(both["settings"][1]["ppl"])
    err, again = streaming("1")  # the same setting again: replaced, not doubled
    assert [s["name"] for s in again["settings"]] == ["x=0 y=8", "x=1 y=8"] and "(1 setting of it kept)" in err
    before = (job / "streaming.json").read_text()
    err, other = streaming("1", n_tokens="150")  # another text: not merged, the earlier file kept apart
    assert "streaming.json: the earlier result (another checkpoint, data or options) kept as streaming.1.json" in err
    assert [s["name"] for s in other["settings"]] == ["x=1 y=8"] and other["n_tokens"] == 150
    assert (job / "streaming.1.json").read_text() == before
    ckpt = job / "checkpoints" / "last.ckpt"
    os.utime(ckpt, ns=(ckpt.stat().st_atime_ns, ckpt.stat().st_mtime_ns + 10**9))  # a retrained job's checkpoint
    err, retrained = streaming("0", n_tokens="150")
    assert "kept as streaming.2.json" in err and [s["name"] for s in retrained["settings"]] == ["x=0 y=8"]
    assert json.loads((job / "streaming.2.json").read_text()) == other
    assert sorted(p.name for p in job.glob("streaming*.json")) == ["streaming.1.json", "streaming.2.json",
                                                                    "streaming.json"]


def test_merge_is_by_setting_name_and_only_of_the_same_measurement():
    retrieval = EVALUATIONS.get("retrieval")
    base = {"source": "sinklab", "task": {"task": "passkey"}, "grid": {"knob": "depth", "values": [0.5]},
            "length": 65, "context": 64, "n_samples": 4, "seed": 0, "checkpoint": {"bytes": 1}, "notes": ["a"]}
    old = {**base, "settings": [{"label": "prefill_dense", "accuracy": 1.0}, {"label": "x", "accuracy": 0.5}]}
    new = {**base, "notes": ["b"], "settings": [{"label": "x", "accuracy": 0.25}, {"label": "y", "accuracy": 0.0}]}
    merged = retrieval.merge(old, new)
    assert [(s["label"], s["accuracy"]) for s in merged["settings"]] == [("prefill_dense", 1.0), ("x", 0.25),
                                                                         ("y", 0.0)]
    assert merged["notes"] == ["a", "b"] and old["settings"][1]["accuracy"] == 0.5  # the inputs are not changed
    for key, value in (("n_samples", 8), ("seed", 1), ("checkpoint", {"bytes": 2}), ("grid", None)):
        assert retrieval.merge(old, {**new, key: value}) is None, key
    assert EVALUATIONS.get("quant").merge(old, old) is None  # declares no settings: its earlier result is kept apart


def test_a_retrieval_csv_tells_jobs_evaluated_at_other_seeds_apart(tmp_path):
    """Job 0 evaluated again at --seed 1 (its result kept apart: another seed), job 1 at seed 0: the sweep's
    retrieval.csv has each job's samples' seed in `eval_seed`, beside the training seed the job ran with."""
    from sinklab.evals.registry import write_table

    setting = {"label": "prefill_dense", "policy": "dense", "budget": None, "knobs": {}, "accuracy": 0.5, "loss": 1.0,
               "first_kept": 1.0, "key_kept": 1.0}
    for job, seed in (("0", 1), ("1", 0)):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- seed={job}\n")
        (tmp_path / job / "retrieval.json").write_text(json.dumps(
            {"seed": seed, "settings": [setting], "sink_heads": 0, "sink_heads_retrieval": None,
             "other_heads_retrieval": None, "heads_rank_correlation": None, "chance": 0.1, "n_samples": 4}))
    out, n = write_table(EVALUATIONS.get("retrieval"), tmp_path)
    rows = list(csv.DictReader(out.open()))
    assert n == 2 and [(r["job"], r["seed"], r["eval_seed"]) for r in rows] == [("0", "0", "1"), ("1", "1", "0")]
