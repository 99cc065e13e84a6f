"""sinklab eval retrieval (sinklab.evals.retrieval, sinklab.cli.retrieval): a real run trained with a passkey task
mixed in, read through evicting caches; what the cache held when the question came; the per-head scores; the sweep
CSV; user errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sinklab.data.retrieval import answer_scores, make_samples
from sinklab.evals import retrieval as rv
from sinklab.runs.run_data import read_run_data
from sinklab.targets import SinklabTarget, TargetSpec, load_target
from tests.helpers import assert_one_line_error, run_cli, train


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    """A short FAST run with a passkey task in half of its training blocks (2 layers, d 64, context 64)."""
    out = tmp_path_factory.mktemp("retrieval") / "run"
    train(out, "trainer.max_steps=40", "data.retrieval.task=passkey", "data.retrieval.rate=0.5",
          "data.retrieval.key_len=3")
    return out


def task_and_text(run):
    return read_run_data(run, {"num_workers": 0}, lambda dm: (dm.retrieval_task, dm.val_text(4000).numpy()), "test",
                         "task", "")


def test_dense_prefill_scores_what_the_full_forward_scores(passkey_run):
    """The dense cache read in two parts (the prompt, then the question) gives the full forward's answer loss and
    accuracy, and holds every key."""
    target = load_target(TargetSpec(str(passkey_run)))
    task, text = task_and_text(passkey_run)
    samples = make_samples(task, 6, 65, 1, text)
    for s in samples:
        got = rv.run_sample(target, s, rv.Setting("prefill", "dense", None))
        tokens = torch.as_tensor(s.tokens)[None]
        with torch.no_grad():
            loss, acc = answer_scores(target.logits(tokens[:, :-1]), tokens, torch.as_tensor(s.answer)[None])
        assert got["accuracy"] == pytest.approx(float(acc)) and got["loss"] == pytest.approx(float(loss), abs=1e-5)
        assert got["first_kept"] == 1.0 and got["key_kept"] == 1.0


@pytest.mark.parametrize("setting", [rv.Setting("decoding", "h2o", 16), rv.Setting("prefill", "snapkv", 16),
                                     rv.Setting("prefill", "pyramidkv", 24, {"window": 4})],
                         ids=lambda s: s.label)
def test_a_batch_scores_each_sample_as_alone(passkey_run, setting):
    """Samples read as one batch (each its own kept sets) give what each gives alone."""
    target = load_target(TargetSpec(str(passkey_run)))
    task, text = task_and_text(passkey_run)
    samples = make_samples(task, 4, 65, 2, text)
    together = rv.run_batch(target, samples, setting)
    for s, got in zip(samples, together):
        alone = rv.run_sample(target, s, setting)
        assert got == pytest.approx(alone, abs=1e-5)


def test_a_result_records_the_rule_each_setting_ran_with(passkey_run):
    """Every knob a policy ran with is in the JSON (`knobs_used`), defaults included, beside the knobs given; the
    sweep CSV has a column per rule (`CachePolicy.rules`): SnapKV's pooling, PyramidKV's schedule, H2O's normalize."""
    target = load_target(TargetSpec(str(passkey_run)))
    task, text = task_and_text(passkey_run)
    cells = {0.5: make_samples(task, 1, 65, 0, text)}
    settings = [rv.Setting("prefill", "snapkv", 16), rv.Setting("prefill", "pyramidkv", 24, {"pooling": "sinklab"}),
                rv.Setting("decoding", "h2o", 16, {"recent": 0.25})]
    res = rv.evaluate(target, cells, settings)
    assert [s["knobs"] for s in res] == [{}, {"pooling": "sinklab"}, {"recent": 0.25}]
    assert res[0]["knobs_used"] == {"window": 8, "kernel": 5, "pooling": "reference"}
    assert res[1]["knobs_used"]["pooling"] == "sinklab" and res[1]["knobs_used"]["schedule"] == "pyramidkv"
    row = rv.Retrieval.row({"settings": res, "sink_heads": 0, "sink_heads_retrieval": None,
                            "other_heads_retrieval": None, "heads_rank_correlation": None, "chance": 0.01,
                            "n_samples": 1, "seed": 3})
    assert {k: v for k, v in row.items() if not k.endswith(("_acc", "_loss", "_kept"))} == {
        "prefill_snapkv_b16_pooling": "reference", "prefill_pyramidkv_b24_pooling": "sinklab",
        "prefill_pyramidkv_b24_schedule": "pyramidkv", "decoding_h2o_b16_normalize": False, "sink_heads": 0,
        "sink_heads_retrieval": None, "other_heads_retrieval": None, "heads_rho": None, "chance": 0.01,
        "n_samples": 1, "eval_seed": 3}
    # a result written before the rules were recorded (no knobs_used) ran SnapKV with sinklab's pooling, the only one
    old = [{k: v for k, v in s.items() if k != "knobs_used"} for s in res]
    assert rv.rules_used(old[0]) == {"pooling": "sinklab"} and rv.rules_used(old[2]) == {"normalize": False}


def test_what_the_cache_holds_when_the_question_comes(passkey_run):
    """A key planted early (depth 0) is gone from a 16-key window by the question, and kept by the dense cache;
    StreamingLLM's first 4 keep token 1, a window does not."""
    target = load_target(TargetSpec(str(passkey_run)))
    task, text = task_and_text(passkey_run)
    early = make_samples(rv.with_knob(task, "depth", 0.0), 3, 65, 0, text)
    for protocol in ("prefill", "decoding"):
        window = [rv.run_sample(target, s, rv.Setting(protocol, "window", 16)) for s in early]
        streaming = [rv.run_sample(target, s, rv.Setting(protocol, "streaming", 16, {"first": 4})) for s in early]
        assert all(r["key_kept"] == 0.0 and r["first_kept"] == 0.0 for r in window)
        assert all(r["first_kept"] == 1.0 for r in streaming)
        assert all(r["key_kept"] == 0.0 for r in streaming)  # the key sits after the first 4: evicted too


def test_head_scores_read_the_maps_of_every_layer_and_head(passkey_run):
    """alpha_1 per (layer, head) is the sink metric's (its brute-force route over full maps), averaged over the
    samples; every score lies in [0, 1] for softmax attention."""
    from sinklab.metrics.sink import brute_force_alpha

    target = load_target(TargetSpec(str(passkey_run)))
    task, text = task_and_text(passkey_run)
    samples = make_samples(task, 3, 65, 0, text)
    heads = rv.head_scores(target, samples)
    cfg = target.model.cfg
    assert cfg.kv_heads == cfg.n_head  # MHA: a kv head is a head
    assert [(h["layer"], h["head"]) for h in heads] == [(la, h) for la in range(cfg.n_layer) for h in range(cfg.n_head)]
    tokens = torch.as_tensor(np.stack([s.tokens[:-1] for s in samples]))
    want = brute_force_alpha(target.model, tokens, k=1).alpha[..., 0].mean(0)  # (L, H)
    got = torch.tensor([h["alpha_1"] for h in heads]).view(cfg.n_layer, cfg.n_head)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for h in heads:
        assert 0.0 <= h["retrieval"] <= 1.0 and 0.0 <= h["streaming"] <= 1.0
    one_at_a_time = rv.head_scores(target, samples, batch=1)  # the same, sample by sample
    for got_head, want_head in zip(heads, one_at_a_time):
        assert got_head.keys() == want_head.keys()
        assert all(got_head[k] == pytest.approx(want_head[k], abs=1e-6) for k in got_head)
    assert max(h["retrieval"] for h in heads) > 0.05  # some head reads the key: the per-sample rows and keys count


@pytest.mark.slow
@pytest.mark.ci
def test_the_command_table_json_plot_and_sweep(capsys, passkey_run, tmp_path):
    args = ["eval", "retrieval", str(passkey_run), "--samples", "2", "--policies", "streaming,h2o",
            "--budgets", "16", "--grid", "depth=0.2,0.8"]
    rc, out, err = run_cli("sinklab", *args, "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    labels = [s["label"] for s in res["settings"]]
    assert labels == ["prefill_dense", "prefill_streaming_b16", "prefill_h2o_b16", "decoding_streaming_b16",
                      "decoding_h2o_b16"]
    assert res["chance"] == pytest.approx(1e-3) and res["grid"] == {"knob": "depth", "values": [0.2, 0.8]}
    for s in res["settings"]:
        assert 0.0 <= s["accuracy"] <= 1.0 and s["loss"] >= 0 and 0.0 <= s["first_kept"] <= 1.0
        assert set(s["cells"]) == {"0.2", "0.8"}
    assert res["settings"][2]["knobs_used"] == {"recent": 0.5, "normalize": False}
    cfg = SinklabTarget.load(TargetSpec(str(passkey_run))).model.cfg
    assert len(res["heads"]) == cfg.n_layer * cfg.kv_heads
    plot = tmp_path / "r.png"
    rc, out, err = run_cli("sinklab", *args, "--plot", str(plot), capsys=capsys)
    assert rc == 0, err
    assert "prefill_dense" not in out and "depth=0.2" in out and "chance 0.1%" in out and "token 1 kept" in out
    assert "Spearman rho(alpha_1, retrieval)" in out and plot.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("args,message", [
    (["--budgets", "70"], "--budgets 70: 70 keys; allowed: 1 <= budget < 64"),
    (["--policies", "nope"], "cache policy 'nope' is unknown; allowed: dense, streaming"),
    (["--grid", "depth=1.5"], "data.retrieval.depth=1.5"),
    (["--grid", "width=3"], "--grid width: task passkey has no knob 'width'"),
    (["--length", "80"], "--length 80: allowed: <= the model context + 1 = 65"),
    (["--knob", "h2o.heavy=1"], "cache policy h2o: unknown knob 'heavy'; allowed: recent, normalize"),
    (["--policies", "snapkv", "--knob", "snapkv.pooling=mean"],
     "cache policy snapkv: pooling 'mean'; allowed: reference, sinklab"),
    (["--knob", "tova.x=4"], "--knob tova.x=4: policy 'tova' is not in --policies"),
    (["--protocols", "later"], "--protocols later: allowed: prefill, decoding"),
    (["--budgets", "2", "--policies", "streaming"], "first 4 must be in [0, budget 2]"),
    (["--length", "8", "--budgets", "1", "--policies", "window"], "data.retrieval.key_len=3"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, passkey_run, args, message):
    rc, out, err = run_cli("sinklab", "eval", "retrieval", str(passkey_run), "--samples", "1", *args, capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, message)


@pytest.mark.slow
@pytest.mark.ci
def test_a_run_without_a_retrieval_task_is_refused(capsys, trained_run):
    rc, out, err = run_cli("sinklab", "eval", "retrieval", str(trained_run), capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "its data has no retrieval task (data.retrieval.task is null)")


@pytest.mark.slow
@pytest.mark.ci
def test_readme_retrieval_commands_run(capsys, passkey_run, tmp_path):
    """Every `sinklab eval retrieval` line of the documentation on the passkey run (--samples 2 instead of 16)."""
    from tests.helpers import readme_cli_lines, readme_commands

    assert any(c.startswith("sinklab-train experiment=retrieval") for c in readme_commands())
    commands = readme_cli_lines("sinklab eval retrieval", {"runs/p": passkey_run, "retrieval.png": tmp_path / "r.png"})
    assert len(commands) >= 3
    for args in commands:
        rc, out, err = run_cli("sinklab", *args, "--samples", "2", capsys=capsys)
        assert rc == 0, (args, err)
        if "--json" in args:
            res = json.loads(out)
            assert res["grid"]["values"] == [0, 0.5, 1] and res["settings"][1]["knobs"] == {"recent": 0.25}
        else:
            assert "token 1 kept" in out
    assert (tmp_path / "r.png").is_file()


@pytest.mark.slow
@pytest.mark.ci
def test_an_exported_model_retrieves_as_the_run_does(capsys, passkey_run, tmp_path):
    """The run exported to transformers (LLaMA) and read with --hf-model on the run's task: the same accuracies and
    kept sets for dense, StreamingLLM and H2O (its maps from the eager kernel), per protocol."""
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    run_cli("sinklab", "export-hf", str(passkey_run), str(hf), "--no-tokenizer", capsys=capsys, check=True)
    common = ["--samples", "3", "--policies", "streaming,h2o", "--budgets", "16", "--json"]
    rc, out, err = run_cli("sinklab", "eval", "retrieval", str(passkey_run), *common, capsys=capsys)
    assert rc == 0, err
    native = json.loads(out)
    rc, out, err = run_cli("sinklab", "eval", "retrieval", "--hf-model", str(hf), "--data", str(passkey_run), *common,
                           capsys=capsys)
    assert rc == 0, err
    exported = json.loads(out)
    assert exported["source"] == "hf"
    for a, b in zip(native["settings"], exported["settings"]):
        assert a["label"] == b["label"]
        for key in ("accuracy", "first_kept", "key_kept"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["label"], key)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-3)
    rc, out, err = run_cli("sinklab", "eval", "retrieval", "--hf-model", str(hf), "--data", str(passkey_run),
                           "--samples", "1", "--policies", "duo", "--budgets", "16", capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "cache policy duo: needs a mask per layer or head")


@pytest.mark.slow
@pytest.mark.ci
def test_duo_with_the_measured_retrieval_heads(capsys, passkey_run):
    """--duo-heads measured names the heads of highest retrieval score as duo's retrieval heads: all of them
    (retrieval=1) is the dense cache; none is a first + recent cache with positions kept (a key evicted is lost)."""
    base = ["eval", "retrieval", str(passkey_run), "--samples", "2", "--policies", "duo", "--budgets", "16",
            "--protocols", "decoding", "--duo-heads", "measured", "--json"]
    rc, out, err = run_cli("sinklab", *base, "--knob", "duo.retrieval=1.0", capsys=capsys)
    assert rc == 0, err
    dense, duo = json.loads(out)["settings"]
    assert duo["label"] == "decoding_duo_b16" and len(duo["knobs"]["heads"]) == len(json.loads(out)["heads"])
    assert duo["accuracy"] == dense["accuracy"] and duo["key_kept"] == 1.0
    rc, out, err = run_cli("sinklab", *base, "--knob", "duo.retrieval=0.0", "--grid", "depth=0", capsys=capsys)
    dense, duo = json.loads(out)["settings"]
    assert duo["knobs"]["heads"] == [] and duo["key_kept"] == 0.0 and duo["first_kept"] == 1.0
