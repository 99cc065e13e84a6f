"""sinklab.report on synthetic sweep dirs laid out as Hydra multirun + Lightning CSVLogger leave them."""
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from sinklab import report
from tests.helpers import REPO, assert_one_line_error, run_cli
from tests.helpers.sweeps import base_config, write_hydra, write_metrics

WDS = [0.0, 0.1, 0.5, 1.0, 2.0]  # jobs 0-3 have dirs; job 4 was not started yet


def make_sweep(root: Path) -> Path:
    sweep = root / "multiruns" / "2025-01-01_00-00-00"
    sweep.mkdir(parents=True)
    mr = base_config()
    mr["hydra"] = {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                               "max_batch_size": None, "params": None},
                   "sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
                   "overrides": {"hydra": ["hydra.mode=MULTIRUN"],
                                 "task": ["experiment=weight_decay", "optim.weight_decay=" + ",".join(map(str, WDS)),
                                          "trainer.max_steps=300"]},
                   "mode": "MULTIRUN"}
    OmegaConf.save(OmegaConf.create(mr), sweep / "multirun.yaml")
    for i, wd in enumerate(WDS[:4]):
        d = sweep / str(i)
        overrides = ["experiment=weight_decay", f"optim.weight_decay={wd}", "trainer.max_steps=300"]
        write_hydra(d, base_config(wd), overrides)
    # 0 and 1 completed
    for i, final_sink in ((0, 12.5), (1, 37.25)):
        write_metrics(sweep / str(i) / "metrics.csv", 300, lambda s, f=final_sink: f * s / 300,
                      lambda s: 5.0 - s / 1000 - 0.01 * i)
        (sweep / str(i) / "status.json").write_text(json.dumps(
            {"status": "completed", "error": None, "step": 300,
             "final": {"val/loss": 4.7 - 0.01 * i, "sink/sink1": final_sink}}))
    # 2 failed at step 63, metrics.csv cut mid-line
    write_metrics(sweep / "2" / "metrics.csv", 50, lambda s: 3.0, lambda s: 5.5, truncate=True)
    (sweep / "2" / "status.json").write_text(json.dumps(
        {"status": "failed", "error": "FloatingPointError: loss is nan at step 63", "step": 63, "final": {}}))
    # 3 has no status.json and a metrics.csv: running while fresh, killed once stale
    write_metrics(sweep / "3" / "metrics.csv", 100, lambda s: 1.0 + s / 100, lambda s: 5.2)
    return sweep


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def report_figures(sweep: Path, now=None) -> dict:
    """The report's figures of a sweep by file name, to look into."""
    from sinklab.report import plots, table

    loaded = report.load_sweep(sweep, now=now)
    return plots.figures(loaded, table.job_table(loaded, report.load_paper_tables())[0])


def test_report_table_status_and_paper_values(tmp_path):
    sweep = make_sweep(tmp_path)
    res = report.build_report(sweep, tmp_path / "out")

    rows = read_csv(res["csv"])
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "4"]  # one row per job, the pending one included
    assert [float(r["optim.weight_decay"]) for r in rows] == WDS
    assert res["swept"] == ["optim.weight_decay"]
    assert [r["status"] for r in rows] == ["completed", "completed", "failed", "running", "pending"]
    # final Sink_1 is the last logged value, exactly what was written
    assert float(rows[0]["sink1"]) == 12.5 and float(rows[1]["sink1"]) == 37.25
    assert float(rows[3]["sink1"]) == 2.0  # 1 + 100/100 at step 100
    assert float(rows[0]["sink2"]) == 0.5 and float(rows[0]["sink4"]) == 0.0
    assert float(rows[0]["val_loss"]) == pytest.approx(5.0 - 0.3)
    assert [r["steps"] for r in rows] == ["300", "300", "63", "100", ""]
    # the failed job: its error, and the value of the complete line before the cut-off one
    assert rows[2]["error"] == "FloatingPointError: loss is nan at step 63"
    assert float(rows[2]["sink1"]) == 3.0 and float(rows[2]["val_loss"]) == 5.5
    assert rows[0]["error"] == "" and rows[4]["sink1"] == ""
    # paper values matched through experiment.paper_match {wd: optim.weight_decay}
    assert [r["paper_sink1"] for r in rows] == ["15.2", "18.18", "41.08", "37.71", "6.13"]
    assert float(rows[1]["paper_loss"]) == 3.73
    assert res["aggregate"] is None and res["aggregate_csv"] is None  # one seed per setting: no seed statistics,
    assert res["differences_csv"] is None and res["claims_csv"] is None and res["claims"] == []  # nor claims
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "report.csv", "report.md", "sink1_over_steps.png", "sink1_vs_optim.weight_decay.png",
        "val_loss_vs_optim.weight_decay.png"]

    md = res["md"].read_text()
    assert str(sweep) in md and "weight_decay" in md
    assert "completed 2, running 1, failed 1, pending 1" in md
    assert f"sinklab report {sweep} --out {tmp_path / 'out'}" in md
    assert md.count("\n| ") >= 6  # header + 5 jobs
    assert "FloatingPointError: loss is nan at step 63" in md
    assert "18.18" in md
    assert [line for line in md.splitlines() if line.startswith("## ")] == ["## Jobs", "## Plots"]  # as before

    names = sorted(p.name for p in res["plots"])
    assert names == ["sink1_over_steps.png", "sink1_vs_optim.weight_decay.png", "val_loss_vs_optim.weight_decay.png"]
    import matplotlib.image as mpimg

    for p in res["plots"]:
        assert f"]({p.name})" in md
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] >= 500 and img.shape[1] >= 800
        assert float(np.std(img[..., :3])) > 0.05  # not a blank canvas


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_stale_jobs_without_status_are_killed_and_running_status_stalled(tmp_path):
    sweep = make_sweep(tmp_path)
    later = time.time() + 3600
    res = report.build_report(sweep, tmp_path / "out", now=later)
    assert [r["status"] for r in res["rows"]] == ["completed", "completed", "failed", "killed", "pending"]
    (sweep / "3" / "status.json").write_text(json.dumps({"status": "running", "error": None, "step": 100}))
    res = report.build_report(sweep, tmp_path / "out", now=later)
    assert res["rows"][3]["status"] == "stalled"
    res = report.build_report(sweep, tmp_path / "out")
    assert res["rows"][3]["status"] == "running"


def test_job_without_metrics_and_half_written_status(tmp_path):
    sweep = make_sweep(tmp_path)
    (sweep / "1" / "metrics.csv").unlink()  # status.json's final values stand in
    (sweep / "0" / "status.json").write_text('{"status": "compl')  # cut off: inferred from the files' age
    for name in ("metrics.csv", "status.json"):
        os.utime(sweep / "0" / name, (time.time() - 7200,) * 2)
    (sweep / "3" / "metrics.csv").unlink()  # failed before training, no status either
    res = report.build_report(sweep, tmp_path / "out")
    rows = {r["job"]: r for r in res["rows"]}
    assert rows["0"]["status"] == "killed" and rows["0"]["sink1"] == 12.5
    assert rows["1"]["status"] == "completed" and rows["1"]["sink1"] == 37.25 and rows["1"]["steps"] == 300
    assert rows["1"]["val_loss"] == pytest.approx(4.69)
    assert rows["3"]["status"] == "unknown" and rows["3"]["sink1"] is None


def test_seeds_are_aggregated(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    job = 0
    values = {}
    for wd in (0.0, 0.5):
        for seed in (0, 1, 2):
            d = sweep / str(job)
            write_hydra(d, base_config(wd, seed), [f"optim.weight_decay={wd}", f"seed={seed}"])
            s1 = 10.0 + 20 * wd + seed
            values.setdefault(wd, []).append(s1)
            write_metrics(d / "metrics.csv", 100, lambda s, v=s1: v, lambda s: 4.0)
            status = "failed" if (wd, seed) == (0.5, 2) else "completed"
            (d / "status.json").write_text(json.dumps({"status": status, "error": None, "step": 100}))
            job += 1
    res = report.build_report(sweep, tmp_path / "out")  # no multirun.yaml: swept keys from differing overrides
    assert res["swept"] == ["optim.weight_decay", "seed"]
    agg = {a["optim.weight_decay"]: a for a in res["aggregate"]}
    assert agg[0.0]["jobs"] == 3 and agg[0.0]["completed"] == 3
    assert agg[0.0]["sink1_mean"] == pytest.approx(11.0) and agg[0.0]["sink1_std"] == pytest.approx(1.0)
    assert agg[0.5]["completed"] == 2 and agg[0.5]["sink1_mean"] == pytest.approx(np.mean(values[0.5][:2]))
    assert agg[0.5]["sink1_std"] == pytest.approx(np.std(values[0.5][:2], ddof=1))
    assert agg[0.5]["paper_sink1"] == 41.08
    assert read_csv(res["aggregate_csv"])[0]["sink1_mean"] == "11.0"
    md = res["md"].read_text()
    assert "Mean ± std over seeds" in md and "11.00 ± 1.00" in md
    assert not (tmp_path / "out" / "sink1_vs_seed.png").exists()  # seeds are averaged, not plotted against


@pytest.mark.slow
@pytest.mark.ci
def test_cli(tmp_path):
    sweep = make_sweep(tmp_path)
    out = tmp_path / "cli_out"
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    p = run_cli("sinklab", "report", str(sweep), "--out", str(out), process=True, env=env, cwd=REPO, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "5 jobs" in p.stdout
    assert (out / "report.md").is_file() and len(read_csv(out / "report.csv")) == 5
    assert (out / "sink1_over_steps.png").is_file()
    # the default out dir, which the next run must not take for a job
    assert run_cli("sinklab", "report", str(sweep)).returncode == 0
    assert (sweep / "report" / "report.csv").is_file()
    assert len(report.build_report(sweep)["rows"]) == 5
    assert run_cli("sinklab", "report", str(tmp_path / "nowhere")).returncode == 1
    tables = tmp_path / "tables.yaml"
    tables.write_text("weight_decay:\n  - {wd: 0.1, sink1: 99.5, loss: 3.0}\n")
    assert run_cli("sinklab", "report", str(sweep), "--out", str(out), "--paper-tables", str(tables)).returncode == 0
    assert [r["paper_sink1"] for r in read_csv(out / "report.csv")] == ["", "99.5", "", "", ""]


def test_extra_metric_columns_from_the_command_and_the_preset(tmp_path):
    sweep = make_sweep(tmp_path)
    res = report.build_report(sweep, tmp_path / "out", metrics=["sink/alpha1"])
    assert [r["sink/alpha1"] for r in res["rows"]][:2] == [12.5 / 200, 37.25 / 200]  # the last logged values
    assert "| sink/alpha1 " in res["md"].read_text()
    mr = OmegaConf.load(sweep / "multirun.yaml")
    mr.experiment.report_metrics = ["sink/alpha1", "sink/sink2"]  # Sink_2 has its own column already
    OmegaConf.save(mr, sweep / "multirun.yaml")
    res = report.build_report(sweep, tmp_path / "out", metrics=["epoch"])
    assert res["columns"].index("sink/alpha1") < res["columns"].index("epoch")
    assert "sink/sink2" not in res["columns"] and [r["epoch"] for r in res["rows"]][:2] == [0, 0]


def test_a_registered_metric_name_stands_for_its_headline_columns(tmp_path):
    """`--metrics first_token_attn` (a name in sinklab.metrics.METRICS) asks for its headline log keys."""
    from sinklab.metrics import METRICS

    sweep = make_sweep(tmp_path)
    assert METRICS.get("sink").headline == ("sink/sink1", "sink/alpha1")
    res = report.build_report(sweep, tmp_path / "out", metrics=["sink"])
    assert "sink/alpha1" in res["columns"] and "sink" not in res["columns"]
    with pytest.raises(Exception, match="act/first_token_attn"):  # its headline key, logged by no job here
        report.build_report(sweep, tmp_path / "out2", metrics=["first_token_attn"])


def test_a_metric_name_stands_for_the_headline_columns_some_job_logged(tmp_path):
    """The `heads` metric logs the head types a model has: `--metrics heads` shows those some job logged (none of
    another type), and is still refused where no job logged any of them."""
    sweep = make_sweep(tmp_path)
    with pytest.raises(Exception, match="heads/rope/sink1"):
        report.build_report(sweep, tmp_path / "out0", metrics=["heads"])
    for i, logged in ((0, {"heads/rope/sink1": 40.0, "heads/rope/qk_max_partial_cycle": 9.5}),
                      (1, {"heads/nope/sink1": 5.0, "heads/nope/qk_max_unrotated": 3.25})):
        status = sweep / str(i) / "status.json"
        data = json.loads(status.read_text())
        data["final"].update(logged)
        status.write_text(json.dumps(data))
    res = report.build_report(sweep, tmp_path / "out", metrics=["heads"])
    shown = [c for c in res["columns"] if c.startswith("heads/")]
    assert shown == ["heads/rope/sink1", "heads/rope/qk_max_partial_cycle", "heads/nope/sink1",
                     "heads/nope/qk_max_unrotated"]  # the headline's order: HEAD_TYPES, then its keys
    assert [r["heads/rope/sink1"] for r in res["rows"]][:2] == [40.0, None]


def test_read_metrics_sparse_rows(tmp_path):
    p = tmp_path / "metrics.csv"
    p.write_text("epoch,sink/sink1,step,train/loss,val/loss\r\n0,,9,5.0,\r\n0,4.5,9,,5.2\r\n0,,19,4.0,\r\n"
                 "0,,19,3.9,\r\n0,7.0,19,,4.8\r\n0,,29,3.5,\r\n0,9.")
    m = report.read_metrics(p)
    assert m.final == {"epoch": 0.0, "sink/sink1": 7.0, "train/loss": 3.5, "val/loss": 4.8}
    assert m.max_step == 29
    assert m.series["sink/sink1"] == [(9, 4.5), (19, 7.0)]
    assert m.series["train/loss"] == [(9, 5.0), (19, 3.9), (29, 3.5)]  # a repeated step keeps the later value


def test_paper_matching_on_the_packaged_tables():
    tables = report.load_paper_tables()

    def row(table, match, cfg):
        return report.match_paper_row(tables[table], match, lambda k: OmegaConf.select(OmegaConf.create(cfg), k))

    assert row("weight_decay", {"wd": "optim.weight_decay"}, {"optim": {"weight_decay": 0.1}})["sink1"] == 18.18
    assert row("weight_decay", {"wd": "optim.weight_decay"}, {"optim": {"weight_decay": 0.3}}) is None
    lr = {"lr": "optim.lr", "steps": "trainer.max_steps"}
    assert row("learning_rate", lr, {"optim": {"lr": 0.0008}, "trainer": {"max_steps": 10000}})["sink1"] == 23.44
    assert row("learning_rate", lr, {"optim": {"lr": 0.0008}, "trainer": {"max_steps": 300}}) is None
    op = {"op": "model.attn_op", "normalized": "model.attn_normalize"}
    assert row("attention_operation", op, {"model": {"attn_op": "sigmoid", "attn_normalize": True}})["sink1"] == 30.24
    assert row("attention_operation", op, {"model": {"attn_op": "sigmoid", "attn_normalize": False}})[
        "sink1_star"] == 0.44
    # softmax's row has no `normalized` field: a wildcard
    assert row("attention_operation", op, {"model": {"attn_op": "softmax", "attn_normalize": True}})["loss"] == 3.73
    failed = row("attention_operation", op, {"model": {"attn_op": "elu_plus_one", "attn_normalize": True}})
    assert report.paper_values(failed) == {"paper_note": "training failed in the paper"}
    pos = row("fixed_token_position", {"position": "data.fixed_token.position"},
              {"data": {"fixed_token": {"position": 2}}})
    assert report.paper_values(pos) == {"paper_sink1": 0.0, "paper_sink2": 69.03, "paper_sink3": 0.0,
                                        "paper_sink4": 0.01}
    batch = {"batch": "data.batch_tokens"}
    assert row("batch_size_tokens", batch, {"data": {"batch_tokens": 250000}})["sink1"] == 16.45
    rnd = {"positions": "data.random_positions"}
    assert row("random_tokens", rnd, {"data": {"random_positions": [1, 2]}})["sink2"] == 14.08
    assert report.match_paper_row(tables["default"], {}, lambda k: None)["sink1"] == 18.18
    assert report.match_paper_row(tables["window"], {}, lambda k: None) is None


def test_values_match_and_x_scale():
    assert report.values_match(4.0e-4, 0.0004) and not report.values_match(0.0, 0.001)
    assert report.values_match("0.25M", 250000) and report.values_match(False, "false")
    assert not report.values_match(True, 1) and not report.values_match([1], [1, 2])
    assert report.values_match("RoPE", "rope") and not report.values_match(None, None)
    assert report.x_scale([1e-4, 4e-4, 1e-3])[0] == "log"
    assert report.x_scale([1, 2, 4])[0] == "linear"
    scale, kw = report.x_scale([0.0, 0.01, 0.1, 1.0])
    assert scale == "symlog" and kw["linthresh"] == 0.01
    assert report.x_scale([-1.0, 0.1, 10.0])[0] == "linear"


def test_categorical_sweep_plots(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for i, pos in enumerate(["nope", "absolute", "alibi", "rope"]):
        cfg = base_config()
        cfg["model"]["pos"] = pos
        cfg["experiment"] = {"name": "positional_encoding", "paper_table": "positional_encoding",
                             "paper_match": {"pos": "model.pos"}}
        write_hydra(sweep / str(i), cfg, [f"model.pos={pos}"])
        write_metrics(sweep / str(i) / "metrics.csv", 100, lambda s, i=i: 5.0 * i, lambda s: 4.0 + i / 10,
                      extra_cols={"sink/slot_bias": 60.0} if pos == "alibi" else None)
        (sweep / str(i) / "status.json").write_text(json.dumps({"status": "completed", "step": 100}))
    res = report.build_report(sweep, tmp_path / "out")
    assert [r["model.pos"] for r in res["rows"]] == ["nope", "absolute", "alibi", "rope"]
    assert [r["paper_sink1"] for r in res["rows"]] == [20.35, 32.73, 20.78, 18.18]
    assert [r["slot_bias"] for r in res["rows"]] == [None, None, 60.0, None]
    assert (tmp_path / "out" / "sink1_vs_model.pos.png").is_file()
    assert (tmp_path / "out" / "val_loss_vs_model.pos.png").is_file()


def test_sink_star_of_a_normalised_op_is_its_sink_where_another_job_logs_sink_star(tmp_path):
    """Sink* is logged only where rows do not sum to one (here a sigmoid job); a softmax job of the same sweep gets
    Sink*_k = Sink_k (renormalising its rows changes nothing), so the two compare on one column; a sweep of
    normalised ops only gets no Sink* column."""
    def sweep_of(ops):
        sweep = tmp_path / "-".join(ops)
        sweep.mkdir()
        for i, op in enumerate(ops):
            cfg = base_config()
            cfg["model"]["attn_op"] = op
            write_hydra(sweep / str(i), cfg, [f"model.attn_op={op}"])
            star = {"sink/sink1_star": 40.0 + i, "sink/sink1_star@0.3": 40.0 + i} if op == "sigmoid" else None
            write_metrics(sweep / str(i) / "metrics.csv", 100, lambda s, i=i: 10.0 + i, lambda s: 4.0,
                          extra_cols=star)
            (sweep / str(i) / "status.json").write_text(json.dumps({"status": "completed", "step": 100}))
        return sweep

    rows = report.build_report(sweep_of(["softmax", "sigmoid"]), tmp_path / "out1")["rows"]
    assert [(r["sink1"], r["sink1_star"]) for r in rows] == [(10.0, 10.0), (11.0, 41.0)]
    rows = report.build_report(sweep_of(["softmax", "relu"]), tmp_path / "out2")["rows"]
    assert all(r.get("sink1_star") is None for r in rows)


@pytest.mark.slow
@pytest.mark.ci
def test_real_hydra_multirun_is_read(tmp_path, capsys):
    """A real Hydra multirun (basic launcher) of a tiny app that leaves the job files of the contract."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text(yaml.safe_dump(base_config()))
    app = tmp_path / "app.py"
    app.write_text(
        "import csv, json, hydra\n"
        "@hydra.main(config_path='conf', config_name='config', version_base='1.3')\n"
        "def main(cfg):\n"
        "    s1 = 100 * cfg.optim.weight_decay + cfg.seed\n"
        "    with open('metrics.csv', 'w', newline='') as f:\n"
        "        w = csv.DictWriter(f, fieldnames=['epoch', 'sink/sink1', 'step', 'val/loss'])\n"
        "        w.writeheader(); w.writerow({'epoch': 0, 'step': 10, 'sink/sink1': s1, 'val/loss': 4.0})\n"
        "    json.dump({'status': 'completed', 'error': None, 'step': 10}, open('status.json', 'w'))\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    sweep = tmp_path / "multirun"
    p = subprocess.run([sys.executable, str(app), "-m", "optim.weight_decay=0.0,0.5", "seed=0,1",
                        f"hydra.sweep.dir={sweep}", "hydra.job.chdir=true"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    res = report.build_report(sweep, tmp_path / "out")
    assert res["swept"] == ["optim.weight_decay", "seed"]
    got = [(r["optim.weight_decay"], r["seed"], r["sink1"], r["paper_sink1"]) for r in res["rows"]]
    assert got == [(0.0, 0, 0.0, 15.2), (0.0, 1, 1.0, 15.2), (0.5, 0, 50.0, 41.08), (0.5, 1, 51.0, 41.08)]
    assert [a["sink1_mean"] for a in res["aggregate"]] == [0.5, 50.5]
    assert all(math.isclose(a["sink1_std"], math.sqrt(0.5)) for a in res["aggregate"])
    # the seed statistics and, against a baseline named on the command line, the paired differences
    low = res["aggregate"][0]  # Sink_1 0 and 1: 0.5 -+ t(0.975, 1) * 0.5 = 0.5 -+ 6.353, within [0, 100]
    assert (low["sink1_n"], low["sink1_ci_low"]) == (2, 0.0) and low["sink1_ci_high"] == pytest.approx(6.8531024)
    rc, out, err = run_cli("sinklab", "report", str(sweep), "--out", str(tmp_path / "out"), "--baseline",
                           "optim.weight_decay=0.0", "--json", capsys=capsys)
    assert rc == 0, err
    out = json.loads(out)
    diff = next(d for d in out["differences"] if d["metric"] == "sink1")
    assert (diff["optim.weight_decay"], diff["pairs"], diff["diff_mean"], diff["higher"]) == (0.5, 2, 50.0, 2)
    assert out["aggregate"][1]["sink1_median"] == 50.5 and out["claims"] == []

    # jobs not started yet come from multirun.yaml alone, in Hydra's own job numbering (the last key fastest)
    pending = tmp_path / "pending"
    shutil.copytree(sweep, pending)
    for i in (1, 2, 3):
        shutil.rmtree(pending / str(i))
    jobs = report.load_sweep(pending).jobs
    assert [str(j.status) for j in jobs] == ["completed", "pending", "pending", "pending"]
    ran = [yaml.safe_load((sweep / str(i) / ".hydra" / "overrides.yaml").read_text()) for i in range(4)]
    assert [j.override_text for j in jobs] == [dict(line.split("=", 1) for line in lines) for lines in ran]


def test_two_swept_keys_match_the_paper_on_both(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    settings = [(lr, steps) for lr in (1e-4, 2e-4, 4e-4, 8e-4) for steps in (10000, 20000)]
    for i, (lr, steps) in enumerate(settings):
        cfg = base_config(lr=lr)
        cfg["trainer"]["max_steps"] = steps
        cfg["experiment"] = {"name": "learning_rate", "paper_table": "learning_rate",
                             "paper_match": {"lr": "optim.lr", "steps": "trainer.max_steps"}}
        write_hydra(sweep / str(i), cfg, [f"optim.lr={lr}", f"trainer.max_steps={steps}"])
        write_metrics(sweep / str(i) / "metrics.csv", 100, lambda s, i=i: 2.0 * i, lambda s, i=i: 4.5 - i / 20)
        (sweep / str(i) / "status.json").write_text(json.dumps({"status": "completed", "step": steps}))
    res = report.build_report(sweep, tmp_path / "out")
    assert res["swept"] == ["optim.lr", "trainer.max_steps"]
    paper = {(r["optim.lr"], r["trainer.max_steps"]): r.get("paper_sink1") for r in res["rows"]}
    assert paper == {(1e-4, 10000): None, (1e-4, 20000): 2.90, (2e-4, 10000): None, (2e-4, 20000): 11.21,
                     (4e-4, 10000): None, (4e-4, 20000): 18.18, (8e-4, 10000): 23.44, (8e-4, 20000): 32.23}
    assert [r["steps"] for r in res["rows"]] == [s for _, s in settings]  # status.json's step beats the last log
    names = {p.name for p in res["plots"]}
    assert {"sink1_vs_optim.lr.png", "sink1_vs_trainer.max_steps.png", "val_loss_vs_optim.lr.png"} <= names


def test_single_run_dir(tmp_path):
    run = tmp_path / "runs" / "2025-01-01_00-00-00"
    write_hydra(run, base_config(), ["optim.weight_decay=0.1"])
    write_metrics(run / "metrics.csv", 100, lambda s: 9.0, lambda s: 4.4)
    (run / "status.json").write_text(json.dumps({"status": "completed", "error": None, "step": 100}))
    res = report.build_report(run)
    assert res["out_dir"] == run / "report" and res["swept"] == []
    assert [(r["job"], r["status"], r["sink1"], r["paper_sink1"]) for r in res["rows"]] == [
        (run.name, "completed", 9.0, 18.18)]
    assert [p.name for p in res["plots"]] == ["sink1_over_steps.png"]
    assert "nothing (single setting)" in res["md"].read_text()
    assert len(report.build_report(run)["rows"]) == 1  # its own report/ dir is not taken for a job


def test_preempted_job_is_preempted_in_the_table_and_on_the_plots(tmp_path):
    """A job that saved last.ckpt on a signal and exited (status.json "preempted") waits to be requeued: the report
    says preempted, however long ago that was, and draws it as preempted, not as running."""
    from sinklab.runs.status import Status, write_status

    sweep = make_sweep(tmp_path)
    write_status(sweep / "3" / "status.json", Status.PREEMPTED, step=100)
    later = time.time() + 3600
    res = report.build_report(sweep, tmp_path / "out", now=later)
    assert [r["status"] for r in res["rows"]] == ["completed", "completed", "failed", "preempted", "pending"]
    assert "Jobs: 5 (completed 2, preempted 1, failed 1, pending 1)" in res["md"].read_text()

    figures = report_figures(sweep, now=later)
    legend = [t.get_text() for t in figures["sink1_vs_optim.weight_decay.png"].axes[0].get_legend().get_texts()]
    assert "preempted" in legend and "failed / killed" in legend and "running" not in legend
    over_steps = [t.get_text() for t in figures["sink1_over_steps.png"].axes[0].get_legend().get_texts()]
    assert "weight_decay=1 (preempted)" in over_steps


def test_values_outside_their_physical_range_are_ignored(tmp_path, caplog):
    """A rate outside [0, 100] %, a negative or non-finite loss or a negative step is not a measurement: it is left
    out (with a warning naming the file), and the mean ± std bars of a rate stay within [0, 100]."""
    p = tmp_path / "metrics.csv"
    p.write_text("epoch,sink/sink1,step,val/loss\n0,4.5,9,5.2\n0,7.0,19,4.8\n0,150.0,29,-1.0\n0,3.0,-5,nan\n")
    m = report.read_metrics(p)
    assert m.final == {"epoch": 0.0, "sink/sink1": 3.0, "val/loss": 4.8} and m.max_step == 29
    assert m.series["sink/sink1"] == [(9, 4.5), (19, 7.0)]
    assert f"{p}: 1 value(s) of sink/sink1 ignored; allowed: a finite number in [0, 100]" in caplog.text
    assert "2 value(s) of val/loss ignored" in caplog.text and "1 value(s) of step ignored" in caplog.text

    sweep = tmp_path / "sweep"
    for i, (wd, s1) in enumerate(((0.1, 0.0), (0.1, 0.0), (0.1, 10.0), (0.5, 20.0))):  # wd 0.1: mean 3.3, std 5.8
        write_hydra(sweep / str(i), base_config(wd, seed=i), [f"optim.weight_decay={wd}", f"seed={i}"])
        write_metrics(sweep / str(i) / "metrics.csv", 100, lambda s, v=s1: v, lambda s: 4.0)
        status = {"status": "completed", "step": 100, "final": {"sink/sink1_star": 101.0}}
        (sweep / str(i) / "status.json").write_text(json.dumps(status))
    res = report.build_report(sweep, tmp_path / "out")
    assert "sink1_star" not in res["columns"]  # status.json's final values are checked the same way
    assert res["aggregate"][0]["sink1_std"] == pytest.approx(np.std([0, 0, 10], ddof=1))
    ax = report_figures(sweep)["sink1_vs_optim.weight_decay.png"].axes[0]
    bars = [seg for c in ax.collections for seg in c.get_segments()]
    assert bars and min(y for seg in bars for _, y in seg) == 0.0


@pytest.mark.parametrize("args, message", [
    (["--stale-minutes", "-1"], "--stale-minutes -1.0 is not allowed; allowed: a number of minutes > 0"),
    (["--paper-tables", "missing.yaml"], "--paper-tables missing.yaml cannot be read"),
    (["--paper-tables", "bad.yaml"], "table weight_decay: sink1=120 is not allowed; allowed: a number in [0, 100]"),
    (["--paper-tables", "list.yaml"], "holds a list; expected a mapping of table names to rows"),
    (["--out", "a_file"], "--out a_file cannot be made a directory (File exists)"),
    (["--metrics", "sink/alpha"], "metric 'sink/alpha' (--metrics / experiment.report_metrics) was logged by no job"
                                  " of"),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, args, message):
    sweep = make_sweep(tmp_path)
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text("weight_decay:\n  - {wd: 0.1, sink1: 120}\n")
    Path("list.yaml").write_text("- 1\n")
    Path("a_file").write_text("")
    rc, out, err = run_cli("sinklab", "report", str(sweep), *args, capsys=capsys)
    assert rc == 1
    assert_one_line_error(err, message, starts="sinklab report: error: ")
