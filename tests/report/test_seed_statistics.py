"""Seed statistics, paired differences and the verdict rule (sinklab.report.stats, .verdicts) on a synthetic sweep
with known per-seed values: the numbers against hand-computed ones, the pairing (jobs in shuffled order, a missing
seed drops its pair) and every verdict case."""
import json
import math
import random

import numpy as np
import pandas as pd
import pytest
import yaml

from sinklab import report
from sinklab.errors import UserError
from sinklab.report import verdicts
from tests.helpers import assert_one_line_error, readme_cli_lines, run_cli
from tests.helpers.sweeps import base_config, write_hydra, write_metrics

T975 = {3: 3.182446305284263, 4: 2.7764451051977987}  # Student's t, 97.5% quantile, by degrees of freedom
SEEDS = range(5)
# final Sink_1 (%) per gate and seed; headwise has no seed 2, g5 only seeds 0 and 1
SINK1 = {"none": [30, 20, 25, 35, 10], "elementwise": [0, 0, 1, 0, 2], "headwise": [32, 10, None, 30, 8],
         "g2_elementwise": [40, 28, 36, 44, 21], "g5_elementwise": [0, 0]}
VAL_LOSS = {"none": 4.2, "elementwise": 4.1, "headwise": 4.15, "g2_elementwise": 4.18, "g5_elementwise": 4.17}
X0_PENALTY = [1.0, 2.0, 1.5, 0.5, 3.0]  # streaming x0 - x4 perplexity of the none jobs
CLAIMS = [
    {"id": "g1_removes_sink", "text": "G1 removes the sink", "setting": {"model/gate": "elementwise"},
     "metric": "sink/sink1", "direction": "lower", "requires": {"metric": "sink/sink1", "above": 10}},
    {"id": "headwise_removes_sink", "setting": {"model/gate": "headwise"}, "metric": "sink/sink1",
     "direction": "lower"},
    {"id": "g2_removes_sink", "setting": {"model/gate": "g2_elementwise"}, "metric": "sink/sink1",
     "direction": "lower"},
    {"id": "g5_removes_sink", "setting": {"model/gate": "g5_elementwise"}, "metric": "sink/sink1",
     "direction": "lower"},
    {"id": "needs_a_big_sink", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1",
     "direction": "lower", "requires": {"above": 50}},
    {"id": "g1_sink_on_both", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1",
     "direction": "lower", "requires": {"above": 10, "of": "both"}},  # the baseline passes, G1's jobs (0.6) do not
    {"id": "g1_small_sink_after", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1",
     "direction": "lower", "requires": {"below": 1, "of": "setting"}},
    {"id": "w4a4", "setting": {"model/gate": "elementwise"}, "metric": "quant/w4a4_gap", "direction": "lower"},
    {"id": "g3_not_run", "setting": {"model/gate": "g3_elementwise"}, "metric": "sink/sink1", "direction": "lower"},
    {"id": "x0_penalty", "setting": {"model/gate": "none"}, "metric": "streaming/x0_y60_ppl",
     "against_metric": "streaming/x4_y60_ppl", "direction": "higher"},
    {"id": "g1_lower_loss_than_headwise", "setting": {"model/gate": "elementwise"},
     "baseline": {"model/gate": "headwise"}, "metric": "val/loss", "direction": "lower"},
]
EXPECTED = {"g1_removes_sink": "reproduced", "headwise_removes_sink": "partly", "g2_removes_sink": "not reproduced",
            "g5_removes_sink": "not testable", "needs_a_big_sink": "not testable",
            "g1_sink_on_both": "not testable", "g1_small_sink_after": "reproduced", "w4a4": "not testable",
            "g3_not_run": "not testable", "x0_penalty": "reproduced", "g1_lower_loss_than_headwise": "reproduced"}


def make_seed_sweep(root, order_seed=0, claims=CLAIMS):
    """One job per (gate, seed) with a value, numbered in a shuffled order; streaming.csv for the none jobs."""
    sweep = root / "sweep"
    cells = [(g, s, v) for g, vals in SINK1.items() for s, v in zip(SEEDS, vals) if v is not None]
    random.Random(order_seed).shuffle(cells)
    streaming = []
    for job, (gate, seed, s1) in enumerate(cells):
        cfg = base_config(seed=seed)
        cfg["experiment"] = {"name": "gates", "paper_table": None, "reference": "synthetic",
                             "baseline": {"model/gate": "none"}, "claims": claims} if claims else \
            {"name": "gate_positions", "paper_table": None, "reference": "synthetic"}  # a preset's name, no claims
        d = sweep / str(job)
        write_hydra(d, cfg, [f"model/gate={gate}", f"seed={seed}"])
        write_metrics(d / "metrics.csv", 100, lambda s, v=s1: float(v), lambda s, g=gate: VAL_LOSS[g] + seed / 100)
        (d / "status.json").write_text(json.dumps({"status": "completed", "step": 100}))
        if gate == "none":
            x4 = 60.0 + seed
            streaming.append({"job": str(job), "model/gate": gate, "seed": seed, "x0_y60_ppl": x4 + X0_PENALTY[seed],
                              "x4_y60_ppl": x4, "n_tokens": 1000})
    pd.DataFrame(streaming).to_csv(sweep / "streaming.csv", index=False)
    return sweep


def t_interval(x, df=None):
    x = np.asarray(x, dtype=float)
    half = T975[df or len(x) - 1] * x.std(ddof=1) / math.sqrt(len(x))
    return x.mean() - half, x.mean() + half


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    return make_seed_sweep(root), report.build_report(make_seed_sweep(root / "b"), root / "out")


def test_seed_statistics_per_setting(built):
    _, res = built
    agg = {a["model/gate"]: a for a in res["aggregate"]}
    g1 = agg["elementwise"]
    assert (g1["jobs"], g1["sink1_n"], g1["sink1_median"], g1["sink1_min"], g1["sink1_max"]) == (5, 5, 0.0, 0.0, 2.0)
    assert g1["sink1_mean"] == pytest.approx(0.6) and g1["sink1_std"] == pytest.approx(math.sqrt(0.8))
    lo, hi = t_interval([0, 0, 1, 0, 2])  # 0.6 -+ 2.776 * 0.4: [-0.51, 1.71]
    assert lo < 0 and g1["sink1_ci_low"] == 0.0  # a rate's interval is kept within [0, 100]
    assert g1["sink1_ci_high"] == pytest.approx(hi) == pytest.approx(1.7105780, abs=1e-6)
    none = agg["none"]
    assert none["sink1_mean"] == 24.0 and none["sink1_median"] == 25.0
    assert (none["sink1_ci_low"], none["sink1_ci_high"]) == pytest.approx(t_interval(SINK1["none"]))
    assert agg["headwise"]["sink1_n"] == 4 and agg["g5_elementwise"]["sink1_n"] == 2
    md = res["md"].read_text()
    assert "## Seed statistics (completed jobs; 95% t-interval of the mean)" in md
    row = next(line for line in md.splitlines() if line.startswith("| elementwise ") and "| Sink_1 (%) " in line)
    assert [c.strip() for c in row.strip("|").split("|")] == ["elementwise", "Sink_1 (%)", "5", "0.60", "[0.00, 1.71]",
                                                             "0.00", "0.00 - 2.00"]


def test_paired_differences_from_the_baseline(built):
    _, res = built
    diffs = {(d["model/gate"], d["metric"]): d for d in res["differences"]}
    assert not any(g == "none" for g, _ in diffs)  # the baseline itself has no difference from itself
    d = diffs["elementwise", "sink1"]
    paired = np.subtract(SINK1["elementwise"], SINK1["none"])  # -30 -20 -24 -35 -8
    assert (d["pairs"], d["lower"], d["higher"], d["baseline"]) == (5, 5, 0, "model/gate=none")
    assert d["diff_mean"] == pytest.approx(-23.4)
    assert (d["diff_ci_low"], d["diff_ci_high"]) == pytest.approx(t_interval(paired))
    assert (d["diff_ci_low"], d["diff_ci_high"]) == pytest.approx((-36.2322, -10.5678), abs=1e-3)
    head = diffs["headwise", "sink1"]  # seed 2 has no headwise job: its pair is dropped
    assert head["pairs"] == 4 and head["diff_mean"] == pytest.approx(np.mean([2, -10, -5, -2]))
    assert (head["diff_ci_low"], head["diff_ci_high"]) == pytest.approx(t_interval([2, -10, -5, -2]))
    assert diffs["g2_elementwise", "val_loss"]["diff_mean"] == pytest.approx(-0.02)
    assert "## Paired differences from the baseline (model/gate=none; by seed, 95% t-interval)" in res["md"].read_text()
    assert report_csv(res["differences_csv"])["metric"].tolist()[:2] == ["sink1", "sink2"]


def report_csv(path):
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def test_each_verdict_case(built):
    _, res = built
    got = {c["claim"]: c for c in res["claims"]}
    assert {k: c["verdict"] for k, c in got.items()} == EXPECTED
    g1 = got["g1_removes_sink"]
    assert (g1["pairs"], g1["claimed_sign"], g1["diff_mean"]) == (5, "5 of 5", pytest.approx(-23.4))
    assert [p["diff"] for p in sorted(g1["pair_values"], key=lambda p: p["seed"])] == [-30, -20, -24, -35, -8]
    assert got["headwise_removes_sink"]["claimed_sign"] == "3 of 4"  # 75%: the interval includes 0
    assert got["headwise_removes_sink"]["reason"] == "the interval includes 0"
    assert got["g2_removes_sink"]["reason"] == "the interval excludes 0 on the wrong side"
    assert got["g5_removes_sink"]["reason"] == "2 pair(s) of seeds; at least 3 needed"
    assert got["needs_a_big_sink"]["reason"] == "precondition fails: baseline mean of sink/sink1 above 50 (it is 24)"
    assert got["g1_sink_on_both"]["reason"] == "precondition fails: setting mean of sink/sink1 above 10 (it is 0.6)"
    assert got["g1_small_sink_after"]["reason"] == ""  # 0.6 below 1 on G1's own jobs: judged
    assert got["w4a4"]["reason"] == "metric quant/w4a4_gap logged by no job"
    assert got["g3_not_run"]["reason"] == "setting not run: model/gate=g3_elementwise"
    x0 = got["x0_penalty"]  # two evaluation columns of the same jobs (streaming.csv), paired
    assert x0["baseline"] == "the same jobs" and x0["metric"] == "streaming/x0_y60_ppl - streaming/x4_y60_ppl"
    assert x0["diff_mean"] == pytest.approx(1.6)
    assert (x0["diff_ci_low"], x0["diff_ci_high"]) == pytest.approx(t_interval(X0_PENALTY))
    loss = got["g1_lower_loss_than_headwise"]  # the claim's own baseline; seed 2 has no headwise job
    assert loss["baseline"] == "model/gate=headwise" and loss["pairs"] == 4
    assert loss["diff_mean"] == pytest.approx(-0.05)
    table = report_csv(res["claims_csv"])
    assert table["verdict"].tolist() == list(EXPECTED.values())
    md = res["md"].read_text()
    assert "## Claims" in md and verdicts.RULE in md and "| g2_removes_sink " in md
    assert "claims.png" in {p.name for p in res["plots"]}


@pytest.mark.slow
@pytest.mark.ci
def test_pairs_hold_a_seed_whatever_the_job_order(built, tmp_path):
    sweep, res = built
    other = report.build_report(make_seed_sweep(tmp_path, order_seed=7), tmp_path / "out")
    for a, b in zip(res["claims"], other["claims"]):
        assert (a["verdict"], a["pairs"], a["claimed_sign"]) == (b["verdict"], b["pairs"], b["claimed_sign"])
        if a["diff_mean"] is not None:
            assert a["diff_mean"] == pytest.approx(b["diff_mean"])
    jobs = {r["job"]: r for r in other["rows"]}
    for claim in other["claims"]:
        for p in claim["pair_values"]:  # each pair: two jobs of the same seed
            assert jobs[p["job"]]["seed"] == jobs[p["base_job"]]["seed"] == p["seed"]


@pytest.mark.parametrize("claim, message", [
    ({"id": "a", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1", "direction": "down"},
     "experiment.claims[0] (a).direction='down' is not allowed; allowed: one of lower, higher"),
    ({"id": "a", "setting": {"model/gate": "elementwise"}, "metric": "sink/sink1", "direction": "lower",
      "threshold": 3}, "experiment.claims[0].threshold is not an option of experiment.claims[0]"),
    ({"id": "a", "setting": {"model/gate": "none"}, "metric": "sink/sink1", "direction": "lower"},
     "experiment.claims[0] (a).setting {model/gate=none} is its baseline {model/gate=none}; allowed: a setting that"),
    ({"id": "a", "setting": {"model/gate": "elementwise"}, "direction": "lower"},
     "experiment.claims[0].metric is missing; required: id, setting, metric, direction"),
])
def test_a_malformed_claim_is_one_line_before_any_work(tmp_path, capsys, claim, message):
    sweep = make_seed_sweep(tmp_path, claims=[claim])
    rc, out, err = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out"), capsys=capsys)
    assert rc == 1
    assert_one_line_error(err, message, starts="sinklab report: error: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.ci
def test_json_and_a_baseline_from_the_command_line(built, tmp_path, capsys):
    sweep, _ = built
    rc, out, err = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out"), "--json", "--baseline",
                           "model/gate=elementwise", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["baseline"] == {"model/gate": "elementwise"} and res["rule"]["min_pairs"] == verdicts.MIN_PAIRS
    d = next(d for d in res["differences"] if d["model/gate"] == "none" and d["metric"] == "sink1")
    assert d["diff_mean"] == pytest.approx(23.4) and d["higher"] == 5
    assert {c["claim"]: c["verdict"] for c in res["claims"]} == EXPECTED  # the claims keep the preset's baseline
    assert res["files"]["claims_csv"].endswith("report_claims.csv")
    rc, out, err = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out"), "--baseline", "model/gate",
                           capsys=capsys)
    assert rc == 1 and "--baseline 'model/gate' is not KEY=VALUE" in err


@pytest.mark.parametrize("diffs, sign, want", [
    ([-1, -2, -3, -1, -2], -1, "reproduced"),
    ([-2, -2, -3, -2, 0.2], -1, "reproduced"),  # 4 of 5, the interval below 0
    ([-1, -2, 3, 1, -0.5], -1, "partly"),  # 3 of 5
    ([-1, 2, 3, 1, -0.5], -1, "not reproduced"),  # 2 of 5
    ([1, 2, 3, 1, 2], -1, "not reproduced"),
    ([-1, -2], -1, "not testable"),
    ([0, 0, 0], 1, "not reproduced"),  # no difference: not the claimed sign
])
def test_the_rule(diffs, sign, want):
    from sinklab.stats import mean_ci

    assert verdicts.verdict(diffs, sign, mean_ci(diffs))[0] == want


def test_a_malformed_preset_claim_is_refused_when_the_config_is_validated():
    from sinklab.config import compose, validate_config

    cfg = compose(["experiment=gate_positions", "experiment.claims.0.direction=down"])
    with pytest.raises(UserError, match=r"^experiment.claims\[0\] \(g1_lower_loss\).direction='down' is not "
                                        "allowed; allowed: one of lower, higher$"):
        validate_config(cfg)


@pytest.mark.slow
@pytest.mark.ci
def test_the_readme_report_commands(built, tmp_path, monkeypatch, capsys):
    """The README's `sinklab report` lines, on the synthetic sweep: the file list with the verdicts, and --json; the
    line with two sweep dirs on the sweep split by seed into two."""
    sweep, _ = built
    lines = readme_cli_lines("sinklab report ", {"logs/train/multiruns/2026-11-22_10-00-00": sweep,
                                                 "logs/train/multiruns/<time>": sweep})
    assert any("--json" in line for line in lines)
    first, later = split_by_seed(make_seed_sweep(tmp_path / "src"), tmp_path)
    two = [args for args in lines if "logs/train/multiruns/2026-11-24_08-00-00" in args]
    assert len(two) == 1
    two[0][1:3] = [str(first), str(later)]
    monkeypatch.chdir(tmp_path)
    for args in lines:
        rc, out, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 0, args
        if "--json" in args:
            assert {c["claim"]: c["verdict"] for c in json.loads(out)["claims"]} == EXPECTED
        else:
            assert "claim g1_removes_sink: reproduced\n" in out and "report_claims.csv" in out
    assert report_csv(tmp_path / "reports" / "no_bos" / "report_claims.csv")["verdict"].tolist() == \
        list(EXPECTED.values())


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_a_sweep_started_before_its_preset_stated_claims_gets_the_presets(tmp_path):
    """No experiment.baseline / claims in the sweep's config: those of conf/experiment/<experiment.name>.yaml."""
    res = report.build_report(make_seed_sweep(tmp_path, claims=None), tmp_path / "out")
    got = {c["claim"]: c for c in res["claims"]}
    assert res["claims_from"] == "conf/experiment/gate_positions.yaml (the sweep's config has none)"
    assert got["g1_removes_sink"]["verdict"] == "reproduced" and got["g1_removes_sink"]["pairs"] == 5
    assert got["g1_lower_loss"]["verdict"] == "reproduced" and got["g1_lower_loss"]["diff_mean"] == pytest.approx(-0.1)
    assert got["g1_lowers_massive"]["reason"] == "metric act/massive_top logged by no job"
    assert res["baseline"] == {"model/gate": "none"} and "Claims from conf/experiment/gate_positions.yaml" in \
        res["md"].read_text()


@pytest.mark.slow
@pytest.mark.ci
def test_another_presets_claims_judged_on_this_sweep(built, tmp_path, capsys):
    """--claims PRESET|FILE: that file's baseline and claims replace the sweep's own (e.g. sink_uses' claims on an
    outliers_quant sweep of the same models); an unknown name is one line listing the presets."""
    sweep, _ = built
    own = tmp_path / "mine.yaml"
    own.write_text(yaml.safe_dump({"experiment": {"baseline": {"model/gate": "none"}, "claims": [
        {"id": "g2_raises_sink", "setting": {"model/gate": "g2_elementwise"}, "metric": "sink/sink1",
         "direction": "higher"}]}}))
    res = report.build_report(sweep, tmp_path / "out", claims_from=str(own))
    assert [(c["claim"], c["verdict"]) for c in res["claims"]] == [("g2_raises_sink", "reproduced")]
    assert res["claims_from"] == f"{own} (--claims)"
    res = report.build_report(sweep, tmp_path / "out2", claims_from="gate_positions")
    assert {c["claim"] for c in res["claims"]} >= {"g1_removes_sink", "g1_lower_loss"}
    rc, out, err = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out3"), "--claims", "nosuch",
                           capsys=capsys)
    assert rc == 1
    assert_one_line_error(err, "--claims nosuch: no such preset or yaml file (allowed: ", "sink_uses")
    assert not (tmp_path / "out3").exists()

# ------------------------------------------------------------------------------------------- an ad hoc sweep
def make_adhoc_sweep(root, swept, values, fixed=("trainer.max_steps=100",)):
    """`sinklab-train -m KEY=A,B ... seed=0,...,4` with no preset: multirun.yaml as Hydra's BasicSweeper writes it,
    one job per (setting, seed) in Hydra's order; `swept` {key: [values]}, `values(setting, seed)` -> (Sink_1,
    val/loss) of a job."""
    import itertools

    from omegaconf import OmegaConf

    sweep = root / "adhoc"
    sweep.mkdir(parents=True)
    grid = {**{k: [str(v) for v in vs] for k, vs in swept.items()}, "seed": [str(s) for s in SEEDS]}
    task = [f"{k}={','.join(vs)}" for k, vs in grid.items()] + list(fixed)
    mr = {"hydra": {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                "max_batch_size": None, "params": None},
                    "overrides": {"hydra": ["hydra.mode=MULTIRUN"], "task": task}, "mode": "MULTIRUN"},
          "experiment": {"name": "default", "paper_table": None}}
    OmegaConf.save(OmegaConf.create(mr), sweep / "multirun.yaml")
    for job, combo in enumerate(itertools.product(*grid.values())):
        setting = dict(zip(grid, combo))
        seed = int(setting.pop("seed"))
        cfg = base_config(seed=seed)
        cfg["experiment"] = {"name": "default", "paper_table": None}
        for key, v in setting.items():
            if "/" not in key:
                node = cfg
                *parents, leaf = key.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = yaml.safe_load(v)
        d = sweep / str(job)
        write_hydra(d, cfg, [f"{k}={v}" for k, v in setting.items()] + [f"seed={seed}", *fixed])
        sink1, loss = values(setting, seed)
        write_metrics(d / "metrics.csv", 100, lambda s, v=sink1: float(v), lambda s, v=loss: v)
        (d / "status.json").write_text(json.dumps({"status": "completed", "step": 100}))
    return sweep


def gate_values(setting, seed):
    return SINK1[setting["model/gate"]][seed], VAL_LOSS[setting["model/gate"]] + seed / 100


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_an_ad_hoc_sweep_is_compared_with_the_swept_keys_default(built, tmp_path, capsys):
    """`sinklab-train -m model/gate=elementwise,none seed=0,1,2,3,4`, no preset: the differences are from the
    schema's default gate (none, ModelConfig's; not the first swept value), paired by seed as a preset's are, and
    the report and the command say which baseline that is and how to name another."""
    sweep = make_adhoc_sweep(tmp_path, {"model/gate": ["elementwise", "none"]}, gate_values)
    res = report.build_report(sweep, tmp_path / "out")
    assert res["baseline"] == {"model/gate": "none"} and res["baseline_from"] == "the default of model/gate"
    assert res["claims"] == [] and res["swept"] == ["model/gate", "seed"]
    diffs = {d["metric"]: d for d in res["differences"]}
    _, preset = built  # the preset sweep of the same values, against its experiment.baseline {model/gate: none}
    same = {d["metric"]: d for d in preset["differences"] if d["model/gate"] == "elementwise"}
    assert diffs.keys() == same.keys() and all(d["model/gate"] == "elementwise" for d in diffs.values())
    for metric, d in diffs.items():
        for field in ("pairs", "diff_mean", "diff_ci_low", "diff_ci_high", "higher", "lower"):
            assert d[field] == pytest.approx(same[metric][field]), (metric, field)
    assert diffs["sink1"]["diff_mean"] == pytest.approx(-23.4)
    note = "baseline model/gate=none (the default of model/gate); another: --baseline model/gate=elementwise"
    assert res["baseline_note"] == note and f"\nB{note[1:]}.\n" in res["md"].read_text()
    out = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out"), capsys=capsys,
                  check=True).stdout.splitlines()  # (--baseline: the preset test above)
    assert out[1] == note and str(tmp_path / "out" / "report_differences.csv") in out


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_a_default_that_was_not_swept_gives_the_first_swept_value(tmp_path):
    """Two swept values: optim.weight_decay's default (the default run's 1.0, conf/scale/quick.yaml) was swept, second,
    and is the baseline; optim.lr's default was not swept, so its first value is, and the report says so. Every
    other setting is compared with the one baseline setting, paired by seed."""
    from sinklab.config import compose

    sink = {("0.0", "0.001"): 10.0, ("0.0", "0.003"): 20.0, ("1.0", "0.001"): 30.0, ("1.0", "0.003"): 45.0}

    def values(setting, seed):
        return sink[setting["optim.weight_decay"], setting["optim.lr"]] + seed, 4.0

    sweep = make_adhoc_sweep(tmp_path, {"optim.weight_decay": ["0.0", "1.0"], "optim.lr": ["0.001", "0.003"]},
                             values)
    res = report.build_report(sweep, tmp_path / "out")
    default_lr = compose([]).optim.lr
    assert default_lr not in (0.001, 0.003) and compose([]).optim.weight_decay == 1.0
    assert res["baseline"] == {"optim.weight_decay": 1.0, "optim.lr": 0.001}
    assert res["baseline_from"] == ("the default of optim.weight_decay; the first swept value of optim.lr: its "
                                    f"default {default_lr} was not swept")
    diffs = {(d["optim.weight_decay"], d["optim.lr"]): d for d in res["differences"] if d["metric"] == "sink1"}
    assert {k: (d["pairs"], d["diff_mean"]) for k, d in diffs.items()} == {
        (0.0, 0.001): (5, pytest.approx(-20.0)), (0.0, 0.003): (5, pytest.approx(-10.0)),
        (1.0, 0.003): (5, pytest.approx(15.0))}


@pytest.mark.parametrize("baseline, message", [
    ("model.gate=none", "--baseline model.gate=none: model.gate is not a swept key of {sweep}; allowed: model/gate"),
    ("model/gate=headwise", "--baseline model/gate=headwise: the sweep ran no job with model/gate=headwise; allowed: "
                            "model/gate=elementwise, model/gate=none"),
    ("seed=0", "--baseline seed=0: seed pairs the jobs (seeds are averaged over, not compared); allowed: model/gate"),
])
def test_a_baseline_the_sweep_did_not_run_is_one_line_before_any_work(tmp_path, capsys, baseline, message):
    sweep = make_adhoc_sweep(tmp_path, {"model/gate": ["elementwise", "none"]}, gate_values)
    rc, _, err = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out"), "--baseline", baseline,
                         capsys=capsys)
    assert rc == 1 and err == f"sinklab report: error: {message.format(sweep=sweep)}\n"
    assert not (tmp_path / "out").exists()



# ------------------------------------------------------------------------------- several sweeps of one preset
def split_by_seed(sweep, root, parts=((0, 1), (2, 3, 4))):
    """The seed sweep as several sweeps would have left it (`seed=0,1` today, `seed=2,3,4` tomorrow, each warm-started
    from its own first stage: init_from differs between the parts, not within one): each job dir, with its number, in
    the dir of its seed's part, and each part's rows of streaming.csv beside them."""
    from omegaconf import OmegaConf

    streaming = pd.read_csv(sweep / "streaming.csv", dtype={"job": str})
    dirs = []
    for i, seeds in enumerate(parts):
        d = root / f"part{i}"
        d.mkdir(parents=True)
        for job in sweep.iterdir():
            if job.is_dir() and OmegaConf.load(job / ".hydra" / "config.yaml").seed in seeds:
                overrides = job / ".hydra" / "overrides.yaml"
                overrides.write_text(yaml.safe_dump([*yaml.safe_load(overrides.read_text()),
                                                     f"init_from=logs/first_stage_{i}"]))
                job.rename(d / job.name)
        streaming[streaming.seed.isin(seeds)].to_csv(d / "streaming.csv", index=False)
        dirs.append(d)
    return dirs


def test_several_sweeps_of_one_preset_are_reported_as_one(built, tmp_path, capsys):
    """Seeds 0-1 in one sweep dir, 2-4 in another: the combined report pairs the seeds across them and gives every
    verdict, interval and evaluation column the single sweep gives."""
    _, whole = built
    parts = split_by_seed(make_seed_sweep(tmp_path / "src"), tmp_path)
    rc, out, err = run_cli("sinklab", "report", *map(str, parts), "--out", str(tmp_path / "out"), "--json",
                           capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert {c["claim"]: c["verdict"] for c in res["claims"]} == EXPECTED
    for a, b in zip(res["claims"], whole["claims"]):
        assert (a["pairs"], a["claimed_sign"]) == (b["pairs"], b["claimed_sign"])
        assert a["diff_mean"] == pytest.approx(b["diff_mean"])
    assert res["swept"] == ["model/gate", "seed"] and len(res["rows"]) == len(whole["rows"])
    jobs = {r["job"]: r for r in res["rows"]}
    assert {j.split("/")[0] for j in jobs} == {"part0", "part1"}
    assert all(r["seed"] in ((0, 1) if j.startswith("part0/") else (2, 3, 4)) for j, r in jobs.items())
    x0 = next(c for c in res["claims"] if c["claim"] == "x0_penalty")  # each dir's own streaming.csv
    assert sorted(p["seed"] for p in x0["pair_values"]) == list(SEEDS)
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"- Sweep dirs: `{parts[0]} {parts[1]}`" in md and f"sinklab report {parts[0]} {parts[1]} --out" in md


def test_several_sweeps_bad_input_is_one_line(tmp_path, capsys):
    a, b = split_by_seed(make_seed_sweep(tmp_path / "src"), tmp_path)
    cases = [([a, b], "2 SWEEP_DIRs need --out, the dir of their combined report"),
             ([a, b, a, "--out", tmp_path / "o"], f"SWEEP_DIR {a} is named twice"),
             ([a, tmp_path / "nowhere", "--out", tmp_path / "o"], f"SWEEP_DIR {tmp_path / 'nowhere'} is not a "
                                                                  "directory")]
    other = make_seed_sweep(tmp_path / "other", claims=None)  # gate_positions, not gates
    cases.append(([a, other, "--out", tmp_path / "o"], f"SWEEP_DIRs of different presets cannot be reported as one: "
                                                       f"{a} (gates), {other} (gate_positions)"))
    for job in b.iterdir():  # the same preset with another claim stated in the later sweep
        if job.is_dir():
            cfg = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
            cfg["experiment"]["claims"] = CLAIMS[:1]
            (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    cases.append(([a, b, "--out", tmp_path / "o"], f"SWEEP_DIRs {a} and {b} state different claims or baselines"))
    for args, message in cases:
        rc, out, err = run_cli("sinklab", "report", *map(str, args), capsys=capsys)
        assert rc == 1, args
        assert_one_line_error(err, message, starts="sinklab report: error: ")
    assert not (tmp_path / "o").exists()
    res = report.build_report([a, b], tmp_path / "o", claims_from="gate_positions")  # --claims says which: no conflict
    assert {c["claim"] for c in res["claims"]} >= {"g1_removes_sink", "g1_lower_loss"}
