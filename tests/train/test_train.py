"""End-to-end training through the Hydra entry point (subprocess, as a user runs it)."""
import csv
import math
import os
import re
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import sinklab
from tests.helpers import FAST, run_cli, run_cli_in_one_process, train

def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def column(path: Path, key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows(path) if r.get(key) not in (None, "")]


# a low threshold: after 60 steps alpha_1 is near uniform (~0.08), and at eps 0.08 the two layers have different
# shares of sink heads, which the closing lines, the heatmap and `sinklab measure` must each put on the same layer
EPS = "0.08"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = train(out, "trainer.max_steps=60", "optim.schedule=constant",  # constant after warmup: see a test below
                 f"callbacks.sink.eps=[{EPS}]")
    return out, proc


def test_training_lowers_loss_and_writes_outputs(run):
    out, proc = run
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert (out / "metrics.csv").is_file() and (out / ".hydra" / "config.yaml").is_file()
    losses = column(out / "metrics.csv", "train/loss")
    # below the uniform guess over the default data's 1024-token vocabulary by > 1 nat, and still falling
    assert losses[-1][1] < math.log(1024) - 1.0 and losses[-1][1] < losses[0][1], losses
    val = column(out / "metrics.csv", "val/loss")
    sink = column(out / "metrics.csv", "sink/sink1")
    assert val and sink and sink[-1][0] == 60  # measured at the end of training
    assert "done: 60 steps" in proc.stdout and "Sink_1" in proc.stdout and "val/loss" in proc.stdout
    assert list((out / "sink_heatmaps").glob("*.png"))
    # the closing lines: where the sink is (on the BOS token of the default data), the heatmap, the run dir last
    closing = proc.stdout[proc.stdout.index("done: 60 steps"):].strip().splitlines()
    assert closing[1].startswith("sink: ") and "the BOS token '<|endoftext|>'" in closing[1], closing
    heatmap = next(line for line in closing if line.startswith("heatmap of alpha_1 per layer x head: "))
    assert Path(heatmap.split(": ", 1)[1]).is_file() and "step0000060" in heatmap
    # the attention atlas of the final model, linked after the heatmap: one frame, its alpha_1 the logged one's
    from sinklab.analysis.atlas import read_page_data

    assert closing[closing.index(heatmap) + 1] == f"atlas: {out / 'atlas.html'}"
    atlas = read_page_data((out / "atlas.html").read_text(encoding="utf-8"))
    assert [f["label"] for f in atlas["frames"]] == ["step 60"] and atlas["queries"][0] == "<|endoftext|>"
    alpha = atlas["frames"][0]["values"]["sink/alpha"]  # (L, H), each to 4 significant digits
    logged = column(out / "metrics.csv", "sink/alpha1")[-1]
    assert logged[0] == 60 and np.mean(alpha) == pytest.approx(logged[1], rel=1e-3)
    assert closing[-1] == f"run dir: {out}"
    assert '"status": "completed"' in (out / "status.json").read_text()


def test_the_summary_the_heatmap_and_measure_number_layers_alike(run, capsys):
    """Layers are numbered from 0 everywhere, as the log keys sink/layer<i>/...: the closing line's "layer i x% of its
    heads", the heatmap's row i and `sinklab measure`'s row i give the same share, which is metrics.csv's
    sink/layer<i>/sink1 of the last step; the heatmap's title is the logged sink/sink1 (not a threshold of the mean
    map)."""
    from PIL import Image

    from tests.helpers import run_cli

    out, proc = run
    last = rows(out / "metrics.csv")
    logged = next(r for r in reversed(last) if r.get("sink/sink1") not in (None, ""))
    assert int(logged["step"]) == 60
    per_layer = {i: float(logged[f"sink/layer{i}/sink1"]) for i in range(2)}
    # distinct per-layer shares, so that a layer numbered from 1 anywhere would show another layer's share
    assert len({f"{v:.1f}" for v in per_layer.values()}) == 2, per_layer
    closing = proc.stdout[proc.stdout.index("done: 60 steps"):].strip().splitlines()
    named = {int(i): share for i, share in re.findall(r"layer (\d+) ([\d.]+)% of its heads", closing[1])}
    assert named and named == {i: f"{v:.1f}" for i, v in per_layer.items() if v > 0}, (closing[1], per_layer)

    png = Image.open(out / "sink_heatmaps" / "alpha1_step0000060.png")
    assert png.text["Title"] == f"alpha_1 at step 60 (Sink_1 = {float(logged['sink/sink1']):.2f}%)"
    heat_rows = dict(re.findall(r"(\d+): ([\d.]+)%", png.text["Description"].split("rows: ", 1)[1]))
    assert heat_rows == {str(i): f"{v:.1f}" for i, v in per_layer.items()}, png.text

    rc, text, err = run_cli("sinklab", "measure", str(out), "--eps", EPS, "--batch-size", "50")
    assert rc == 0, err
    table = text[text.index("alpha_1 per layer and head"):].splitlines()[2:4]
    measured = {int(line.split()[0]): line.split()[2] for line in table}
    assert measured == {i: f"{v:.1f}" for i, v in per_layer.items()}, table


def test_throughput_and_mfu_are_logged(run):
    """peak_flops=auto (the default) measures this machine's matmul FLOP/s when training starts, so perf/mfu is
    logged next to perf/tokens_per_sec without any setting."""
    out, _ = run
    for key in ("perf/tokens_per_sec", "perf/mfu"):
        values = [v for _, v in column(out / "metrics.csv", key)]
        assert len(values) >= 5 and all(math.isfinite(v) and v > 0 for v in values), (key, values)
    assert all(v < 1.5 for _, v in column(out / "metrics.csv", "perf/mfu"))  # a share of a measured peak


def test_peak_matmul_flops_is_quick_and_leaves_the_rng_alone():
    from sinklab.train.throughput import matmul_dtype, peak_matmul_flops

    torch.manual_seed(0)
    state = torch.get_rng_state()
    t0 = time.perf_counter()
    peak = peak_matmul_flops(torch.device("cpu"), matmul_dtype("32-true"))
    assert time.perf_counter() - t0 < 2.0 and 1e8 < peak < 1e14
    assert torch.equal(torch.get_rng_state(), state)
    assert matmul_dtype("bf16-mixed") == torch.bfloat16 and matmul_dtype("16-mixed") == torch.float16


def test_the_datasheet_peak_is_the_dense_one_for_an_h200():
    """CUDA calls an H200 SXM "NVIDIA H200" (seen on the GPU machine), which Lightning's table does not match, and
    its H200 rows hold the sparse figures: MFU is measured against the dense 989.4 TFLOP/s (the H100 SXM's, which
    Lightning lists dense)."""
    from lightning.fabric.utilities.throughput import _CUDA_FLOPS

    from sinklab.train.throughput import datasheet_peak, dense_16bit

    assert dense_16bit("NVIDIA H200", torch.bfloat16) == _CUDA_FLOPS["h100 sxm"][torch.bfloat16]
    assert dense_16bit("NVIDIA H200 NVL", torch.bfloat16) < dense_16bit("NVIDIA H200", torch.bfloat16)
    assert 2 * dense_16bit("NVIDIA H200", torch.float16) <= 1.01 * _CUDA_FLOPS["h200 sxm1"][torch.float16]
    assert dense_16bit("NVIDIA H200", torch.float32) is None  # Lightning's table answers for other dtypes
    assert dense_16bit("NVIDIA H100 80GB HBM3", torch.bfloat16) is None
    assert datasheet_peak(torch.device("cpu"), torch.bfloat16) is None


def test_load_model_from_run_dir_and_checkpoint(run):
    out, _ = run
    for target in (out, out / "checkpoints" / "last.ckpt"):
        model = sinklab.load_model(target)
        assert not model.training
        idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
        assert model(idx).shape == (2, 16, model.cfg.vocab_size)


def test_resume_from_last_continues_the_step_count(run, tmp_path):
    out, _ = run
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    train(resumed, "trainer.max_steps=80", "ckpt_path=last")
    steps = [s for s, _ in column(resumed / "metrics.csv", "train/loss")]
    assert max(steps) >= 79 and min(s for s in steps if s > 60) > 60
    ckpt = torch.load(resumed / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 80


@pytest.fixture(scope="module")
def short(tmp_path_factory) -> Path:
    """The run of `run` stopped at 40 steps (a constant lr after warmup)."""
    out = tmp_path_factory.mktemp("short")
    train(out, "trainer.max_steps=40", "optim.schedule=constant")
    return out


def test_a_longer_constant_lr_run_repeats_the_shorter_one_step_for_step(run, short):
    """With a constant lr after warmup, the 60-step run logs exactly the losses and sink metric of a 40-step run over
    its first 40 steps: the data order and the schedule do not depend on max_steps, so a long run's early
    measurements stand for the shorter runs (what experiment=no_bos's training-token axis rests on)."""
    longer, _ = run
    for key in ("train/loss", "sink/alpha1", "val/loss"):
        first = column(short / "metrics.csv", key)
        assert first, key
        assert column(longer / "metrics.csv", key)[:len(first)] == first, key
    assert max(s for s, _ in column(longer / "metrics.csv", "train/loss")) > 40


# ---------------------------------------------------------------------------------------------- model.compile
def backend_is_installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def fails_to_compile_backward(gm, example_inputs):
    raise RuntimeError("this backward compiler always fails")


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.skipif(backend_is_installed("tvm"), reason="apache-tvm is installed: the tvm backend would compile")
def test_compile_failure_falls_back_to_eager_with_one_warning():
    """torch.compile is lazy: it compiles at the first forward. A backend that fails there (tvm, registered in torch
    but not installed here: BackendCompilerFailed), or one whose backward compiler fails (AOTAutograd compiles the
    backward lazily, at the first backward), gives one warning naming the reason, and the forward and backward of
    that same call and of the later ones are eager's. A backend that works (aot_eager) stays compiled, silently."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    from sinklab.train.module import CompileFallbackWarning, LitLM

    if "bw_fails_test" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(name="bw_fails_test", compiler_fn=aot_autograd(
            fw_compiler=lambda gm, example_inputs: gm, bw_compiler=fails_to_compile_backward))
    model = dict(vocab_size=128, n_layer=2, n_head=2, d_model=32, d_ff=64, block_size=16)
    optim = dict(lr=1e-3, weight_decay=0.1)
    batches = [torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def steps(lit):
        losses = []
        for batch in batches:
            lit.zero_grad(set_to_none=True)
            loss = lit.loss(batch)
            loss.backward()
            losses.append(loss.detach())
        grads = [p.grad.clone() for p in lit.net.parameters()]
        with torch.no_grad():
            lit.eval()
            val = lit.loss(batches[0])
        return losses, grads, val

    torch.manual_seed(0)
    eager = steps(LitLM(model=model, optim=optim, max_steps=2))
    # what tvm raises depends on torch: ImportError: Please install apache-tvm (2.13), ModuleNotFoundError: No module
    # named 'tvm' (2.11)
    for backend, reason in (("tvm", "(BackendCompilerFailed: backend='tvm' raised: "),
                            ("bw_fails_test", "this backward compiler always fails"),
                            ("aot_eager", None)):
        torch.manual_seed(0)
        lit = LitLM(model={**model, "compile": True}, optim=optim, max_steps=2, compile_backend=backend)
        assert lit.model is not lit.net  # torch.compile accepted it: the failure, if any, comes at the first call
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = steps(lit)
        ours = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
        if reason is None:
            assert ours == [] and lit.model is not lit.net, ours
            torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
            continue
        assert len(ours) == 1 and reason in ours[0] and "running eager from now on" in ours[0], ours
        assert lit.model is lit.net
        for a, b in zip(got[0] + got[1] + [got[2]], eager[0] + eager[1] + [eager[2]]):
            assert torch.equal(a, b)  # eager is eager: bit for bit


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.skipif(backend_is_installed("tvm"), reason="apache-tvm is installed: the tvm backend would compile")
def test_compile_failure_in_a_real_run_trains_as_eager(short, tmp_path):
    """sinklab-train model.compile=true compile_backend=tvm: compilation fails at the first forward; the run warns
    once, finishes, and its losses and weights equal the eager run's (`short`, 40 steps)."""
    proc = train(tmp_path, "trainer.max_steps=40", "optim.schedule=constant", "model.compile=true",
                 "compile_backend=tvm", warnings="default", process=True)  # the warning as a user sees it
    warned = proc.stderr.count("model.compile=true: torch.compile failed (BackendCompilerFailed")
    assert warned == 1, proc.stderr[-3000:]
    assert "done: 40 steps" in proc.stdout
    assert column(tmp_path / "metrics.csv", "train/loss") == column(short / "metrics.csv", "train/loss")
    a = sinklab.load_model(tmp_path).state_dict()
    b = sinklab.load_model(short).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_keys_load_across_compiled_and_eager():
    """A compiled model saves model._orig_mod.* keys, an eager one model.*: resuming either from the other (a
    changed model.compile, or a run whose compilation fell back) loads every weight."""
    from sinklab.train.module import LitLM

    model = dict(vocab_size=64, n_layer=1, n_head=2, d_model=16, d_ff=32, block_size=8)
    optim = dict(lr=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    compiled = LitLM(model={**model, "compile": True}, optim=optim, max_steps=1, compile_backend="aot_eager")
    torch.manual_seed(1)
    eager = LitLM(model=model, optim=optim, max_steps=1)
    for source, target in ((compiled, eager), (eager, compiled)):
        checkpoint = {"state_dict": {k: v.clone() for k, v in source.state_dict().items()}}
        target.on_load_checkpoint(checkpoint)
        target.load_state_dict(checkpoint["state_dict"])  # strict: every key matches
        a, b = source.net.state_dict(), target.net.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("model._orig_mod.") for k in compiled.state_dict())


def test_unknown_compile_backend_is_refused_before_training():
    from sinklab.config import compose, validate_config
    from sinklab.errors import UserError

    with pytest.raises(UserError, match=r"^compile_backend='indcutor' is not allowed; allowed: one of .*\binductor\b"):
        validate_config(compose(["model.compile=true", "compile_backend=indcutor"]))
    validate_config(compose(["compile_backend=indcutor"]))  # not used without model.compile=true


@pytest.mark.slow
@pytest.mark.ci
def test_wandb_offline_without_key_and_one_run_per_job(tmp_path):
    """logger=wandb with no API key goes offline by itself; each multirun job is its own wandb run, grouped as
    <experiment name>-<sweep dir name> and tagged from the config; a single run's group is <experiment name>-<run
    time>."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    env.update(HOME=str(tmp_path), PYTHONWARNINGS="ignore", SINKLAB_CACHE=os.environ.get(
        "SINKLAB_CACHE", str(Path.home() / ".cache" / "sinklab")))
    sweep, single = tmp_path / "2026-11-22_10-00-00", tmp_path / "single"
    started = time.time()
    # the sweep, then a single run, one after the other in one process of that environment
    proc, single_proc = run_cli_in_one_process("sinklab-train", [
        ["-m", f"hydra.sweep.dir={sweep}", "logger=wandb", *FAST, "trainer.max_steps=4",
         "callbacks.sink.every_n_steps=2", "seed=0,1", "experiment.name=wb", "tags=[wb,scale-cpu]"],
        [f"paths.output_dir={single}", "logger=wandb", *FAST, "trainer.max_steps=3", "callbacks.sink.every_n_steps=2",
         "+callbacks.nan={_target_:tests.helpers.faults.NanGradientsAt,step:1}"]], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(sweep.glob("*/wandb/offline-run-*"))
    assert len(runs) == 2, runs  # one offline run per job, finished before the next job
    for job in ("0", "1"):
        record = wandb_run_record(next((sweep / job / "wandb").glob("offline-run-*/run-*.wandb")))
        assert record.config["seed"] == int(job) and record.config["optim"]["lr"] == 6e-3  # the config (scale=quick lr)
        assert record.group == "wb-2026-11-22_10-00-00"  # one group for the sweep: experiment name + sweep time
        assert record.tags == ["wb", "scale-cpu"]
        assert f"seed={job}" in record.name.split(",") and "experiment.name=wb" in record.name  # the job's overrides
        assert record.exit_code == 0 and "run/failed" not in record.history_keys
    assert (sweep / "0" / "metrics.csv").is_file()  # csv stays on next to wandb

    # diverged: failed in status.json, metrics.csv and wandb
    assert single_proc.returncode == 1, single_proc.stderr[-3000:]
    record = wandb_run_record(next((single / "wandb").glob("offline-run-*/run-*.wandb")))
    match = re.fullmatch(r"default-(\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d)", record.group)
    assert match, record.group
    run_time = time.mktime(time.strptime(match.group(1), "%Y-%m-%d_%H-%M-%S"))
    assert started - 2 <= run_time <= time.time() + 1
    assert record.tags == [] and record.exit_code == 1 and "run/failed" in record.history_keys


def wandb_run_record(path: Path) -> SimpleNamespace:
    """Read the config, group, run name, tags, logged keys and exit code of an offline wandb run from its transaction log."""
    import json

    from wandb.proto import wandb_internal_pb2

    out = SimpleNamespace(config={}, group="", name="", tags=[], history_keys=set(), exit_code=None)
    for data in leveldb_log_records(path.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.group = rec.run.run_group or out.group
            out.name = rec.run.display_name or out.name
            out.tags = list(rec.run.tags) or out.tags
            for item in rec.run.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            out.history_keys.update(item.key or "/".join(item.nested_key) for item in rec.history.item)
        elif kind == "exit":
            out.exit_code = rec.exit.exit_code
    return out


def leveldb_log_records(raw: bytes, block: int = 32768):
    """wandb's transaction log: a 7-byte file header, then LevelDB-log records (crc32, length, type) in 32 KiB
    blocks; types FULL=1, FIRST=2, MIDDLE=3, LAST=4."""
    import struct

    assert raw[:4] == b":W&B", "not a wandb transaction log"
    pos, parts = 7, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        payload = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            parts = payload
        elif kind == 3:
            parts += payload
        elif kind == 4:
            yield parts + payload
        else:
            break


def test_closing_lines_say_where_the_sink_is_and_what_to_try():
    from sinklab.train.summary import closing_lines

    final = {"val/loss": 4.25, "sink/sink1": 25.0, "sink/alpha1": 0.151}
    lines = closing_lines(1500, final, {0: 0.0, 1: 75.0, 2: 0.0}, "the BOS token 'B'", 0.3, 24, Path("/r"))
    assert lines[0] == "done: 1500 steps, val/loss 4.2500, Sink_1 25.00% (alpha_1 0.151)"
    assert lines[1] == ("sink: 6.0 of 24 heads (mean over the probe sequences) put > 0.3 of their attention on "
                        "token 1, the BOS token 'B'; by layer: layer 1 75.0% of its heads")  # from 0, as the log keys
    assert lines[2].startswith("next: sinklab-train model/bias=k") and "model/attn=sigmoid" in lines[2]
    assert lines[-1] == "run dir: /r"  # no heatmap file in /r: no heatmap line
    atlas = closing_lines(1500, final, {1: 75.0}, "B", 0.3, 24, Path("/r"), Path("/r/atlas.html"))
    assert atlas[2] == "atlas: /r/atlas.html" and atlas[3].startswith("next: ")
    none = closing_lines(10, {"sink/sink1": 0.0, "sink/alpha1": 0.07}, {0: 0.0}, "the BOS token 'B'", 0.3, 8,
                         Path("/r"))
    assert none[1].startswith("sink: none: no head puts > 0.3")
    assert not any(line.startswith("next:") for line in none)
    assert closing_lines(10, {}, {}, None, None, None, Path("/r")) == ["done: 10 steps", "run dir: /r"]
    # rows that do not sum to one (sigmoid): the renormalised share is the one that says where the sink is
    star = closing_lines(10, {"sink/sink1": 90.0, "sink/alpha1": 0.5, "sink/sink1_star": 0.0}, {0: 90.0}, "B", 0.3,
                         8, Path("/r"))
    assert star[0].endswith("Sink*_1 0.00% (rows renormalised)"), star
    assert star[1].startswith("sink: none: no head puts > 0.3"), star
    # a K bias: the heads sink on the slot instead
    slot = closing_lines(10, {"sink/sink1": 0.0, "sink/slot_bias": 62.5}, {0: 0.0}, "B", 0.3, 8, Path("/r"))
    assert "bias slot: 62.50% of the heads sink on it instead (sink/slot_bias)" in slot


def test_aux_losses_dsa_kl_is_logged_falls_in_the_warmup_and_sparse_attention_starts_at_its_step(tmp_path):
    """An auxiliary loss (DSA's indexer KL) is logged as train/aux/<name> and train/aux/total, train/loss stays the
    next-token loss; over the dense warm-up the KL falls (the indexer learns the main attention); the op is dense
    while the step the module tells it is below dsa_warmup_steps, sparse from that step on, and a checkpoint keeps
    the step (a loaded model measures in the sparse phase)."""
    import lightning as L
    import pandas as pd
    from lightning.pytorch.loggers import CSVLogger

    from sinklab.train.module import LitLM

    warmup = 6
    model = dict(vocab_size=64, n_layer=1, n_head=2, d_model=32, d_ff=64, block_size=16, attn_op="dsa",
                 dsa_warmup_steps=warmup, dsa_topk=4)
    torch.manual_seed(0)
    lit = LitLM(model=model, optim=dict(lr=3e-3, weight_decay=0.0, warmup_steps=0, schedule="constant"),
                max_steps=10)
    op = lit.net.blocks[0].attn.op
    seen = []  # (step, dense, KL, next-token loss, total) after each training step

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            m = trainer.callback_metrics
            seen.append((trainer.global_step - 1, op.dense, float(m["train/aux/dsa_kl"]), float(m["train/loss"]),
                         float(outputs["loss"])))

    batch = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))  # one batch, every step
    trainer = L.Trainer(max_steps=10, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Watch()], default_root_dir=tmp_path)
    trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader([batch[i] for i in range(8)], batch_size=8))
    assert [s for s, *_ in seen] == list(range(10))
    assert [dense for _, dense, *_ in seen] == [s < warmup for s in range(10)]
    kl = [k for _, _, k, _, _ in seen]
    assert all(k > 0 for k in kl) and kl[warmup - 1] < 0.8 * kl[0], kl  # the warm-up's KL falls
    for _, _, k, lm, total in seen:  # the step's loss is the next-token loss plus the KL
        assert total == pytest.approx(lm + k, rel=1e-5)
    logged = pd.read_csv(next(tmp_path.glob("**/metrics.csv")))
    assert logged["train/aux/dsa_kl"].notna().sum() == 10
    assert (logged["train/aux/total"].dropna().values == logged["train/aux/dsa_kl"].dropna().values).all()
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = sinklab.load_model(tmp_path / "last.ckpt").blocks[0].attn.op
    assert (loaded.step, loaded.dense) == (9, False)


@pytest.mark.parametrize("shape", [(1, 1), (3, 8), (6, 16), (12, 32)])
def test_the_heatmaps_margins_keep_every_label_on_the_canvas(shape, tmp_path):
    """The heatmap's margins are computed once per shape (`heatmap_margins`, a tight layout of the widest labels)
    instead of a tight layout per drawing: with the widest labels a run can log (every layer 100.0%, a seven-digit
    step), every text of the figure (title, axis labels, tick labels, values, the colour bar's) lies on the canvas,
    and the PNG is written with its Title."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from sinklab.train.callbacks import heatmap_figure, heatmap_margins, save_heatmap

    L_, H = shape
    rows = [f"{L_ - 1}: 100.0%"] * L_
    fig = heatmap_figure(np.ones(shape), rows, "alpha_1 at step 9999999 (Sink_1 = 100.00%)")
    fig.subplots_adjust(**heatmap_margins(L_, H))
    fig.canvas.draw()  # places the axis labels and the ticks
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    texts = [t for ax in fig.axes for t in ax.findobj(plt.Text) if t.get_visible() and t.get_text()]
    texts += [t for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
    assert len(texts) >= L_ * H + L_ + 4  # the values, the row labels, the title, two axis labels, the bar's label
    for t in texts:
        box = t.get_window_extent(renderer)
        assert canvas.x0 - 1 <= box.x0 and box.x1 <= canvas.x1 + 1 and canvas.y0 - 1 <= box.y0 \
            and box.y1 <= canvas.y1 + 1, (t.get_text(), box, canvas)
    plt.close(fig)
    logged = {"sink/sink1": 100.0, **{f"sink/layer{i}/sink1": 100.0 for i in range(L_)}}
    path = save_heatmap(torch.ones(shape), tmp_path, 9999999, logged)
    assert Image.open(path).text["Title"] == "alpha_1 at step 9999999 (Sink_1 = 100.00%)"


# a preset's sweep at one step a job (tiny3 at T = 64)
PRESET_FAST = ["optim.warmup_steps=0", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
               "trainer.log_every_n_steps=1", "callbacks.sink.every_n_steps=2",
               "callbacks.checkpoint.every_n_train_steps=2", "data.batch_size=2", "data.probe_num_seqs=8",
               "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "peak_flops=null"]


@pytest.mark.slow  # two preset sweeps of 2-4 one-step jobs (~40 s)
@pytest.mark.ci
def test_a_second_stage_starts_each_job_from_its_first_stage_job(tmp_path):
    """experiment=retrieval_warm init_from=SWEEP_DIR (a retrieval_base sweep): each job starts from the job of that
    sweep with its design and seed, here job 3 (gate, seed 1) of 4: after one step at a tiny lr its weights are that
    job's, far from the same design's other seed. Without init_from, or with a seed the first stage did not run, the
    run is refused in one line before any data is read."""
    first, second = tmp_path / "first", tmp_path / "second"
    stage1, stage2, missing, other_seed = run_cli_in_one_process("sinklab-train", [
        ["-m", "experiment=retrieval_base", "experiment.variant=softmax,gate", "seed=0,1", f"hydra.sweep.dir={first}",
         *PRESET_FAST, "trainer.max_steps=2"],
        ["-m", "experiment=retrieval_warm", "experiment.variant=gate", "seed=1", f"init_from={first}",
         f"hydra.sweep.dir={second}", *PRESET_FAST, "trainer.max_steps=1", "optim.lr=1e-7"],
        ["experiment=retrieval_warm", f"paths.output_dir={tmp_path / 'none'}"],
        ["experiment=retrieval_warm", "seed=7", f"init_from={first}", f"paths.output_dir={tmp_path / 'seven'}"]],
        env={"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert stage1.returncode == 0 and stage2.returncode == 0, (stage1.stderr[-2000:], stage2.stderr[-2000:])
    log = (second / "0" / "train.log").read_text()
    assert f"init_from: {first / '3'}, the job with seed=1, experiment.variant=gate" in log, log
    assert f"init_from={first / '3'}: weights of step 2 copied" in log

    def weights(job_dir):
        sd = torch.load(job_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        return torch.cat([v.flatten() for k, v in sorted(sd.items()) if "emb" not in k and "lm_head" not in k])

    warm = weights(second / "0")
    assert (warm - weights(first / "3")).norm() < 1e-3 * (warm - weights(first / "2")).norm()
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "error: init_from is missing: experiment=retrieval_warm starts from the models of " \
           "experiment=retrieval_base" in missing.stderr
    assert other_seed.returncode == 2 and other_seed.stderr.count("\n") == 1, other_seed.stderr
    assert f"init_from={first}: no job of that sweep has this run's seed=7, experiment.variant=softmax (its jobs: " \
           "0: seed=0, experiment.variant=softmax; 1: seed=1" in other_seed.stderr
    assert not (tmp_path / "seven" / "checkpoints").exists()


def test_a_sweeps_job_is_matched_by_seed_varied_keys_and_group_choices(tmp_path):
    """`matching_job`, which init_from=SWEEP_DIR uses: a config group the first stage varied (model/gate=...) is
    matched by the group choice its jobs saved (.hydra/hydra.yaml), a config key by its composed value (or by the
    value experiment.first_stage_setting gives it), the seed always (also where that sweep ran one seed); no match or
    two are one line each."""
    import yaml
    from omegaconf import OmegaConf

    from sinklab.errors import UserError
    from sinklab.runs.run_data import is_sweep_dir, matching_job
    from tests.helpers.sweeps import base_config, write_hydra

    sweep = tmp_path / "first"
    for job, (gate, seed) in enumerate([("none", 0), ("elementwise", 0), ("none", 1), ("elementwise", 1)]):
        d = sweep / str(job)
        write_hydra(d, {**base_config(seed=seed), "paths": {"output_dir": "x"}}, [f"model/gate={gate}", f"seed={seed}"])
        (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {
            "model/gate": gate, "data": "shakespeare"}}}}))
    assert is_sweep_dir(sweep) and not is_sweep_dir(sweep / "0") and not is_sweep_dir(tmp_path / "nowhere")
    cfg = OmegaConf.create(base_config(seed=1))
    job, settings = matching_job(sweep, cfg, {"model/gate": "elementwise", "data": "shakespeare"})
    assert job == sweep / "3" and settings == {"seed": 1, "model/gate": "elementwise"}
    with pytest.raises(UserError, match=r"^init_from=.*first: no job of that sweep has this run's seed=1, "
                                        r"model/gate=headwise \(its jobs: 0: seed=0, model/gate=none; "):
        matching_job(sweep, cfg, {"model/gate": "headwise"})
    one_seed = tmp_path / "one_seed"  # a sweep of one seed: the seed is still compared
    for job in range(2):
        write_hydra(one_seed / str(job), {**base_config(seed=0, wd=job / 10), "paths": {"output_dir": "x"}},
                    [f"optim.weight_decay={job / 10}"])
    with pytest.raises(UserError, match=r"no job of that sweep has this run's seed=1, optim.weight_decay=0.1 "):
        matching_job(one_seed, OmegaConf.create(base_config(seed=1, wd=0.1)), {})
    assert matching_job(one_seed, OmegaConf.create(base_config(seed=0, wd=0.1)), {})[0] == one_seed / "1"
    # a second stage whose jobs all start from one setting of the first (experiment.first_stage_setting)
    fixed = OmegaConf.create(base_config(seed=0, wd=0.5))
    fixed.experiment.first_stage_setting = {"optim.weight_decay": 0.0}
    assert matching_job(one_seed, fixed, {}) == (one_seed / "0", {"seed": 0, "optim.weight_decay": 0.0})
    twice = tmp_path / "twice"  # two jobs of the same settings (a rerun beside the first)
    for job in ("0", "rerun"):
        write_hydra(twice / job, base_config(seed=0), ["seed=0"])
    with pytest.raises(UserError, match=r"^init_from=.*twice: 2 jobs have this run's seed=0 \(0, rerun\); name one: "
                                        r"init_from=.*twice/0$"):
        matching_job(twice, OmegaConf.create(base_config(seed=0)), {})


def test_init_from_is_a_warm_start_of_the_runs_weights_with_a_grown_vocabulary(run, tmp_path):
    """init_from=RUN starts a new run from RUN's weights: here with data.retrieval's two marker ids added (the
    vocabulary grows, the new rows start fresh), at rate 0 so the blocks are the same text. Its loss at step 0 is
    RUN's last, not a fresh model's; the step count starts at 0; a resume of it (ckpt_path=last) ignores init_from;
    another architecture is refused in one line before any data is read."""
    out, _ = run
    grown = ("data.retrieval.task=passkey", "data.retrieval.rate=0.0")
    steps = ("trainer.max_steps=2", "trainer.log_every_n_steps=1", "trainer.val_check_interval=2")
    warm = train(tmp_path / "warm", f"init_from={out}", *grown, *steps)
    fresh = train(tmp_path / "fresh", *grown, *steps)
    last = column(out / "metrics.csv", "train/loss")[-1][1]
    (step0, warm0), *_ = column(warm.dir / "metrics.csv", "train/loss")
    (_, fresh0), *_ = column(fresh.dir / "metrics.csv", "train/loss")
    assert step0 == 0 and abs(warm0 - last) < 0.5 and fresh0 - warm0 > 1.0, (warm0, last, fresh0)
    log = (warm.dir / "train.log").read_text()
    assert f"init_from={out}: weights of step 60 copied (tok_emb.weight" in log, log
    saved = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    now = torch.load(warm.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert now["model.tok_emb.weight"].shape[0] > saved["model.tok_emb.weight"].shape[0]
    resumed = train(warm.dir, f"init_from={out}", *grown, "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                    "ckpt_path=last")
    assert "ignored: the run resumes from" in (resumed.dir / "train.log").read_text()
    bad = train(tmp_path / "bad", f"init_from={out}", "model.n_layer=3", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert f"init_from={out}: its model differs from this run's (model.n_layer=2 there, 3 here)" in bad.stderr
