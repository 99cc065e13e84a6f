"""Reliability of `sinklab-train`: bad input refused with one clear line, crashes resumed exactly, failures contained.

Training runs go through the real entry point (`sinklab.train.entry.main`, what the `sinklab-train` console script
calls) with a small model on a small local corpus (a BPE of 320 ids trained once for the module), in this process
where that is enough and in a subprocess where a process has to die (SIGKILL, SIGTERM). A few test-only callbacks
below are added through the config (`+callbacks.x._target_=tests.helpers.faults.X`), as a user could add their own.
docs/reliability.md lists what is validated and which test checks it. The checks that start a process of their own, a
sweep or DDP (~5-15 s each) are marked `slow` and `ci`: out of the default suite, run by CI after it (.ci/run).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sinklab.runs.checkpoints import read_checkpoint
from sinklab.config import compose, validate_config
from sinklab.errors import UserError
from tests.helpers import (REPO, assert_one_line_error, data_args, error_lines, rows, run_cli, run_cli_in_one_process,
                           series, small, start_cli)
from tests.helpers.cli import process_env


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def weights(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(path)["state_dict"]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"training exited ({proc.returncode}) before {path.name}:\n{out[-2000:]}\n"
                                 f"{err[-3000:]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"no {path} after {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """An uninterrupted 8-step run: what every interrupted and resumed run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    run_cli("sinklab-train", f"paths.output_dir={out}", *small(corpus), check=True)
    assert status(out)["status"] == "completed"
    return out


# ---------------------------------------------------------------------------------------------- bad config
BAD_OVERRIDES = [
    # (override, the one line the user sees; matched at its start after "error: ")
    ("optim.lrr=1", "optim.lrr is not an option of optim (did you mean optim.lr?); allowed: betas, eps, "
                    "exclude_norm_and_embedding, freeze_pretrained, freeze_pretrained_steps, lr, min_lr_ratio, "
                    "new_lr_scale, schedule, warmup_steps, weight_decay; to add a "
                    "new key on purpose write +optim.lrr=1"),
    ("model=huge", "model=huge: there is no config model/huge.yaml; allowed: 14m, 1b, 60m, smollm2_135m, tiny"),
    ("model/attn=softmaxx", "model/attn=softmaxx: there is no config model/attn/softmaxx.yaml; allowed: "),
    ("optim.lr=abc", "optim.lr='abc' is not allowed; allowed: a number > 0"),
    ("optim.lr=[1", "cannot parse the override 'optim.lr=[1'"),
    ("model.window=1000", "model.window=1000 exceeds the context model.block_size=64; allowed: 1..64 or null"),
    ("trainer.max_steps=-1", "trainer.max_steps=-1 is not allowed; allowed: an integer >= 1 (the train loader is "
                             "endless, so training is bounded by steps)"),
    ("model.pos=rotary", "model.pos='rotary' is not supported; allowed: nope, sinusoidal, learnable, rope, alibi, "
                         "nape, relative"),
    ("model.prefix_len=64", "model.prefix_len=64 must be smaller than the context model.block_size=64"),
    ("data.probe_seq_len=128", "data.probe_seq_len=128 exceeds the model context model.block_size=64; allowed: 1..64"),
    ("model.n_head=3", "model.n_head=3 does not divide model.d_model=128"),
    ("model.head_dim=9", "model.pos=rope needs an even head size, got head size 9"),
    ("model.n_layer=0", "model.n_layer=0 must be a positive integer"),
    ("seed=-1", "seed=-1 is not allowed; allowed: an integer >= 0"),
    ("data.batch_size=abc", "data.batch_size='abc' is not allowed; allowed: an integer >= 1"),
    ("data.block_size=128", "data.block_size=128 exceeds the model context model.block_size=64; allowed: 1..64"),
    ("trainer.val_check_interval=0.5", "trainer.val_check_interval=0.5 is not allowed; allowed: an integer >= 1"),
    ("+trainer.max_stepz=3", "trainer.max_stepz is not an option of trainer (did you mean trainer.max_steps?)"),
    ("+seeds=1", "seeds is not an option (did you mean seed?); allowed: callbacks, ckpt_path, compile_backend, data, "
                 "experiment, hydra, init_from, local, logger, model, optim, paths, peak_flops, scale, seed, tags, "
                 "task_name, trainer"),
    ("trainer.bogus=1", "trainer.bogus is not an option of trainer; allowed: accelerator, "),
    ("trainer.max_steps=abc", "trainer.max_steps='abc' is not allowed; allowed: an integer >= 1 (the train loader is "
                              "endless, so training is bounded by steps)"),
    ("trainer.precision=fp8", "trainer.precision='fp8' is not allowed; allowed: one of auto, 64-true"),
    ("trainer=gpu", "trainer.accelerator=gpu: this machine has no CUDA GPU; allowed here: trainer=cpu or "
                    "trainer=ddp_cpu (or trainer.accelerator=cpu)"),
    ("optim.schedule=linear", "optim.schedule='linear' is not allowed; allowed: one of cosine, constant"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] is not allowed; allowed: a list of 2 numbers in [0, 1)"),
    ("callbacks.sink.every_n_steps=0", "callbacks.sink.every_n_steps=0 is not allowed; allowed: an integer >= 1"),
    ("callbacks.sink.eps=[1.5]", "callbacks.sink.eps=[1.5] is not allowed; allowed: a list of one or more "
                                 "thresholds in (0, 1)"),
    ("callbacks.sink.k=0", "callbacks.sink.k=0 is not allowed; allowed: an integer >= 1"),
    ("callbacks.sink.k=100", "callbacks.sink.k=100 exceeds the probe length data.probe_seq_len=64; allowed: 1..64"),
    ("callbacks.checkpoint.save_on_exception=true", "callbacks.checkpoint.save_on_exception=true is not allowed"),
    ("callbacks.preemption.signals=[SIGFOO]", "callbacks.preemption.signals=['SIGFOO'] is not allowed; allowed: "),
    ("data=local", "data.corpus=local needs data.files: set it on the command line, e.g. data.files=[a.txt,b.jsonl]"),
    ("+callbacks.x._target_=foo.Bar", "callbacks.x._target_='foo.Bar' cannot be imported (ModuleNotFoundError: "
                                      "No module named 'foo'); check the class path"),
    ("ckpt_path=last", "ckpt_path=last: no checkpoint at "),
    ("ckpt_path=/nonexistent/x.ckpt", "ckpt_path=/nonexistent/x.ckpt: no such file; allowed: null, last, auto or "
                                      "a .ckpt path"),
    ("init_from=/nonexistent/x.ckpt", "init_from=/nonexistent/x.ckpt: checkpoint /nonexistent/x.ckpt does not exist"),
    ("optim.freeze_pretrained=true", "optim.freeze_pretrained=true trains only the parameters a retrofit adds, and "
                                     "this run has none (no init_from, or its model config adds no component"),
    ("optim.freeze_pretrained_steps=5", "optim.freeze_pretrained_steps=5 applies with optim.freeze_pretrained=true "
                                        "only; allowed: freeze_pretrained=true, or freeze_pretrained_steps=null"),
]


@pytest.mark.parametrize("override,expected", BAD_OVERRIDES, ids=[o for o, _ in BAD_OVERRIDES])
def test_bad_override_is_one_clear_line_and_exit_2(override, expected, tmp_path, capsys):
    if override == "trainer=gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = run_cli("sinklab-train", f"paths.output_dir={tmp_path}", override, capsys=capsys)
    assert code == 2, (out, err)
    assert_one_line_error(err, starts="error: " + expected, logs=True)
    assert "Traceback" not in out
    assert not (tmp_path / "metrics.csv").exists() and not (tmp_path / "checkpoints").exists()  # nothing ran


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# refused with paths.output_dir at a finished run, one of each kind: the config's own check, a missing file, a data
# setting, a resume and a warm start into another architecture (`ci`: every bad override above)
REFUSED_AT_A_RUN = ["model.window=1000", "ckpt_path=/nonexistent/x.ckpt", "data=local", "trainer=gpu"]


@pytest.mark.parametrize("every", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.ci])],
                         ids=["some", "every"])
def test_a_refused_command_leaves_an_existing_run_as_it_was(every, reference, corpus, tmp_path, capsys):
    """Bad overrides, and a resume or a warm start into another architecture, with paths.output_dir at a finished
    run: each is refused in one line, and every file of the run is byte for byte as it was (its record, .hydra/, is
    written by sinklab-train once a run is accepted, not by Hydra when the command starts)."""
    import shutil

    run = Path(shutil.copytree(reference, tmp_path / "run"))
    before = file_bytes(run)
    assert ".hydra/config.yaml" in before and ".hydra/overrides.yaml" in before and "status.json" in before
    refused = [[o] for o, _ in BAD_OVERRIDES if (every or o in REFUSED_AT_A_RUN) and
               not (o == "trainer=gpu" and torch.cuda.is_available())]
    refused += [[*small(corpus), "ckpt_path=last", "model.n_layer=3"],
                [*small(corpus), f"init_from={reference}", "model.n_layer=3"],
                [*small(corpus), f"init_from={reference}", "data.vocab_size=400"]]
    for overrides in refused:
        code, out, err = run_cli("sinklab-train", f"paths.output_dir={run}", *overrides, capsys=capsys)
        assert code == 2, (overrides, out, err[-2000:])
        line = assert_one_line_error(err, starts="error: ", logs=True)
        if "data.vocab_size=400" in overrides:  # refused from the settings, before the data is read
            assert "its vocabulary comes from another tokenizer (data.vocab_size=" in line and "400 here" in line
            assert "model:" not in err and "tokenizer" not in err.replace(line, "")
        after = file_bytes(run)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        assert not changed, f"{overrides}: changed {changed}"


@pytest.mark.slow
@pytest.mark.ci
def test_console_script_reports_hydra_errors_in_one_line(tmp_path):
    """The real command line: Hydra's own error for an unknown key, as one line and exit 2 (Hydra: 7 lines, exit 1)."""
    proc = start_cli("sinklab-train", f"paths.output_dir={tmp_path}", "optim.lrr=1", warnings="ignore")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert assert_one_line_error(err, logs=True) == f"error: {BAD_OVERRIDES[0][1]}"


@pytest.mark.slow
@pytest.mark.ci
def test_preset_file_with_an_unknown_or_mistyped_trainer_key_is_one_line(tmp_path, monkeypatch):
    """A preset file is checked against the trainer's schema like the command line: an unknown key or a value of the
    wrong type is one line naming the file and the key, exit 2 (a copy of conf/ with two bad presets,
    SINKLAB_CONF, which sinklab reads when it is imported: both calls in one process of that environment)."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "trainer" / "typo.yaml").write_text("defaults:\n  - default\nmax_stepss: 3\n")
    (conf / "trainer" / "words.yaml").write_text("defaults:\n  - default\nmax_steps: many\n")
    monkeypatch.setenv("SINKLAB_CONF", str(conf))
    presets = {"typo": "conf/trainer/typo.yaml: trainer.max_stepss is not an option of trainer (did you mean "
                       "trainer.max_steps?); allowed: accelerator, ",
               "words": "conf/trainer/words.yaml: trainer.max_steps='many' is not allowed; allowed: an integer >= 1"}
    ran = run_cli_in_one_process("sinklab-train", [[f"paths.output_dir={tmp_path / preset}", f"trainer={preset}"]
                                                   for preset in presets], warnings="ignore")
    for (preset, expected), (code, out, err) in zip(presets.items(), ran):
        assert code == 2, err[-3000:]
        assert_one_line_error(err, starts=f"error: {expected}", logs=True)
        assert not (tmp_path / preset / "metrics.csv").exists()


def test_gpu_presets_compose_and_validate():
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import FSDPStrategy

    ddp = compose(["trainer=ddp"])
    validate_config(ddp)
    assert ddp.trainer.strategy == "ddp" and ddp.trainer.devices == 4 and ddp.trainer.use_distributed_sampler is False
    fsdp = compose(["trainer=fsdp", "model=1b"])
    validate_config(fsdp)
    assert isinstance(instantiate(fsdp.trainer.strategy), FSDPStrategy)
    ddp_cpu = compose(["trainer=ddp_cpu"])
    validate_config(ddp_cpu)
    assert ddp_cpu.trainer.strategy == "ddp_spawn" and ddp_cpu.trainer.devices == 2


def test_a_bug_still_shows_its_traceback(corpus, tmp_path, capsys):
    """Only user errors are shortened: an exception from code (here a callback's constructor) propagates out of
    main() with its traceback, and status.json says failed."""
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match="boom: a bug"):
        run_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus),
                "+callbacks.boom._target_=tests.helpers.faults.Boom")
    assert status(tmp_path)["status"] == "failed" and "boom" in status(tmp_path)["error"]


# ---------------------------------------------------------------------------------------------- bad data
def _short(tmp: Path) -> list[str]:
    p = tmp / "short.txt"
    p.write_text("To be, or not to be.\n", encoding="utf-8")
    return [str(p)]


def _empty(tmp: Path) -> list[str]:
    (tmp / "empty.txt").write_text("")
    return [str(tmp / "empty.txt")]


def _latin1(tmp: Path) -> list[str]:
    (tmp / "latin1.txt").write_bytes("Ophelia sang a song in the café.\n".encode("latin-1"))
    return [str(tmp / "latin1.txt")]


BAD_FILES = [
    ("missing", lambda tmp: [str(tmp / "missing.txt")], r"data.files: .*missing.txt does not exist"),
    ("empty", _empty, r"data.files: .*empty.txt is empty \(0 bytes\)"),
    ("non-utf8", _latin1, r"data.files: .*latin1.txt is not valid UTF-8 \(byte 0xe9 at offset \d+\); fix the file, "
                          r"or set data.encoding_errors=replace"),
    ("shorter-than-a-block", _short, r"has \d+ tokens, fewer than one block of block_size \+ 1 = 33"),
]


@pytest.mark.parametrize("name,make,expected", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_data_file_is_one_line_and_exit_2(name, make, expected, corpus, tmp_path, capsys):
    import re

    files = make(tmp_path)
    code, out, err = run_cli("sinklab-train", f"paths.output_dir={tmp_path / 'run'}", *small(corpus),
                             *data_args(files, tmp_path / "cache"), capsys=capsys)
    assert code == 2, (out, err)
    line = assert_one_line_error(err, starts="error: ", logs=True)
    assert re.search(expected, line), line
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """A token directory as `sinklab prepare` writes it (the data module's store for the test corpus)."""
    from sinklab.data import LMDataModule

    out = tmp_path_factory.mktemp("prepared")
    dm = LMDataModule(corpus="local", files=corpus.files, cache_dir=str(out), vocab_size=300, block_size=32,
                      val_num_blocks=4, probe_num_seqs=8, probe_seq_len=16).prepare()
    return dm.store_dir


def test_damaged_or_foreign_token_store_is_one_line(prepared, corpus, tmp_path, capsys):
    import shutil

    from sinklab.data.tokenizer import train_bpe

    store = tmp_path / "store"
    shutil.copytree(prepared, store)
    shard = store / "train" / "shard_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    base = [f"paths.output_dir={tmp_path / 'run'}", *small(corpus), f"data.prepared_dir='{store}'"]
    code, _, err = run_cli("sinklab-train", *base, capsys=capsys)
    assert code == 2
    assert_one_line_error(err, "shard_00000.bin is truncated or damaged", logs=True)
    # another tokenizer than the one the directory was built with
    shutil.rmtree(store)
    shutil.copytree(prepared, store)
    other = train_bpe([Path(f).read_text()[::-1] for f in corpus.files], 300)
    other.save(str(tmp_path / "other.json"))
    code, _, err = run_cli("sinklab-train", *base, f"data.tokenizer='{tmp_path / 'other.json'}'", capsys=capsys)
    assert code == 2
    assert_one_line_error(err, "was built with another tokenizer", logs=True)


# ---------------------------------------------------------------------------------------------- bad checkpoints
class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('EVIL_MARKER', '/tmp/sinklab-evil')}",))


@pytest.mark.slow
@pytest.mark.ci
def test_truncated_foreign_or_unsafe_checkpoint_is_refused(reference, corpus, tmp_path, capsys, monkeypatch):
    import shutil

    from sinklab.runs.checkpoints import load_model
    from sinklab.train.checkpoint_io import AtomicCheckpointIO

    good = reference / "checkpoints" / "last.ckpt"

    def resume_from(make, *extra: str) -> str:
        run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        (run_dir / "checkpoints").mkdir(parents=True)
        make(run_dir / "checkpoints" / "last.ckpt")
        code, _, err = run_cli("sinklab-train", f"paths.output_dir={run_dir}", *small(corpus), "ckpt_path=last",
                               *extra, capsys=capsys)
        assert code == 2, err
        return assert_one_line_error(err, logs=True)

    # truncated (a copy cut short, as a writer killed mid-save would leave it)
    line = resume_from(lambda p: p.write_bytes(good.read_bytes()[: good.stat().st_size // 2]))
    assert "last.ckpt is not a readable sinklab checkpoint (RuntimeError: it is truncated or not a torch checkpoint" \
        in line
    # foreign: a torch file without a sinklab model
    line = resume_from(lambda p: torch.save({"state_dict": {"w": torch.zeros(2)}}, p))
    assert "last.ckpt is not a sinklab checkpoint (no state_dict / model hyper-parameters)" in line
    # weights without the trainer state
    line = resume_from(lambda p: torch.save({k: v for k, v in torch.load(good, weights_only=True).items()
                                             if k in ("state_dict", "hyper_parameters")}, p))
    assert "cannot resume training: it has no global_step, loops, optimizer_states" in line
    # a checkpoint of another architecture than the config's
    line = resume_from(lambda p: shutil.copy(good, p), "model.n_layer=2")
    assert "was trained with another model (model.n_layer=1 there, 2 here)" in line
    # a file whose unpickling would run code: refused, and the code never runs
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"model": {}}, "x": Evil()}, evil)
    line = resume_from(lambda p: shutil.copy(evil, p))
    assert "is not a readable sinklab checkpoint (UnpicklingError: it holds Python objects other than tensors" in line
    with pytest.raises(UserError, match="is not a readable sinklab checkpoint"):
        load_model(evil)
    with pytest.raises(Exception, match="Weights only load failed"):  # Lightning's resume path loads through this
        AtomicCheckpointIO().load_checkpoint(evil)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- atomic saves
class SlowToPickle:
    """Pickling it writes a marker and then hangs: the process can be killed in the middle of a save."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        Path(self.marker).write_text("saving")
        time.sleep(600)
        return (str, ("never",))


def test_kill_during_a_checkpoint_save_keeps_the_previous_file(tmp_path):
    from sinklab.train.checkpoint_io import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    target = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 4, "w": torch.arange(1000.0)}, target)
    marker = tmp_path / "saving"
    pid = os.fork()
    if pid == 0:  # child: start a save that hangs half-way, and get SIGKILLed there
        try:
            io.save_checkpoint({"global_step": 6, "w": torch.zeros(1000), "slow": SlowToPickle(str(marker))}, target)
        finally:
            os._exit(1)
    end = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < end:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert marker.exists()
    stale = list(target.parent.glob(".last.ckpt.*.tmp"))
    assert len(stale) == 1  # the half-written temporary file; last.ckpt itself was never opened for writing
    ckpt = io.load_checkpoint(target)
    assert ckpt["global_step"] == 4 and torch.equal(ckpt["w"], torch.arange(1000.0))
    io.save_checkpoint({"global_step": 8, "w": torch.ones(3)}, target)  # the next save clears the leftover
    assert not list(target.parent.glob(".last.ckpt.*.tmp")) and io.load_checkpoint(target)["global_step"] == 8
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as readable as a plain file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------- NaN
def test_nan_stops_with_the_step_and_keeps_the_last_good_checkpoint(corpus, tmp_path, capsys):
    """A test callback (tests.helpers.faults.NanGradientsAt) poisons the gradients of step 5 (as a diverging
    update would): the weights after
    step 5 are NaN. The checkpoint due after step 5 (every 2 steps here, at global step 6) is refused, so last.ckpt
    stays the one of step 4, and the run is marked failed."""
    code, out, err = run_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus),
                             "callbacks.checkpoint.every_n_train_steps=2",
                             "+callbacks.nan._target_=tests.helpers.faults.NanGradientsAt", "+callbacks.nan.step=5",
                             capsys=capsys)
    assert code == 1, (out, err)
    assert_one_line_error(err, "training stopped without saving them, the last good checkpoint is kept (",
                          starts="error: the weights after step 6 are not finite (", logs=True)
    ckpt = read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    st = status(tmp_path)
    assert st["status"] == "failed" and st["error"].startswith("TrainingDiverged: the weights after step 6")
    # steps 0..4 logged, all finite (step 5 failed before its row was written)
    assert max(series(tmp_path / "metrics.csv", "train/loss")) == 4
    assert all(math.isfinite(float(v)) for v in series(tmp_path / "metrics.csv", "train/loss").values())
    # the metrics say failed too: one last row run/failed=1 at the step where training stopped
    assert series(tmp_path / "metrics.csv", "run/failed") == {6: "1.0"}
    assert int(float(rows(tmp_path / "metrics.csv")[-1]["step"])) == 6


@pytest.mark.slow
@pytest.mark.ci
def test_sweep_contains_failed_jobs_and_reports_them(corpus, tmp_path, capsys):
    """A multirun where jobs fail in each way a job can (a NaN loss at step 3, between checkpoints; a bug: an
    exception raised by a callback at step 1; a user error: a callback class that does not exist) and one trains:
    the sweep finishes with exit 0, the failed jobs are failed in status.json (with their error), in metrics.csv
    where they got to train, and in `sinklab report`; the job after them completes. ckpt_path=auto starts every job
    fresh (no checkpoint yet). Hydra sweeps the product of the two swept keys: 2 x 3 = 6 jobs."""
    from sinklab.report import load_sweep

    sweep = tmp_path / "sweep"
    faults = ["{_target_:tests.helpers.faults.BugAt,step:1}", "{_target_:tests.helpers.faults.NoSuchCallback}", "null"]
    code, _, err = run_cli("sinklab-train", "-m", f"hydra.sweep.dir={sweep}", *small(corpus), "trainer.max_steps=4",
                           "ckpt_path=auto", "callbacks.checkpoint.every_n_train_steps=2",
                           "+callbacks.fault=" + ",".join(faults),
                           "+callbacks.nan=" + ",".join(["{_target_:tests.helpers.faults.NanGradientsAt,step:2}",
                                                         "null"]), capsys=capsys)
    assert code == 0
    jobs = {}
    for job in sorted(sweep.glob("[0-9]*"), key=lambda p: int(p.name)):
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        nan = "NanGradientsAt" in overrides
        fault = "BugAt" if "BugAt" in overrides else "NoSuchCallback" if "NoSuchCallback" in overrides else None
        jobs[(nan, fault)] = job
    assert len(jobs) == 6, sorted(jobs)
    report = {j.name: j for j in load_sweep(sweep).jobs}

    nan_job = jobs[(True, None)]
    assert "error: non-finite training loss (nan) at step 3; training stopped, the last good checkpoint is kept (" \
        in err
    assert status(nan_job)["status"] == "failed"
    assert read_checkpoint(nan_job / "checkpoints" / "last.ckpt")["global_step"] == 2
    assert series(nan_job / "metrics.csv", "run/failed") == {3: "1.0"}
    assert report[nan_job.name].status == "failed" and \
        "non-finite training loss (nan) at step 3" in report[nan_job.name].error

    for nan in (True, False):
        bug = jobs[(nan, "BugAt")]  # the bug comes first, at step 1 (the NaN would come at step 3)
        st = status(bug)
        assert st["status"] == "failed" and st["error"] == "ZeroDivisionError: bug in a callback at step 1", st
        assert series(bug / "metrics.csv", "run/failed") == {1: "1.0"}
        assert report[bug.name].status == "failed" and "bug in a callback at step 1" in report[bug.name].error
        user = jobs[(nan, "NoSuchCallback")]  # refused before any data is loaded: no metrics.csv
        st = status(user)
        assert st["status"] == "failed" and st["error"].startswith(
            "UserError: callbacks.fault._target_='tests.helpers.faults.NoSuchCallback' cannot be imported"), st
        assert not (user / "metrics.csv").exists() and report[user.name].status == "failed"
    for nan in (True, False):  # a bug's traceback is in the job's log, not swallowed
        job_log = (jobs[(nan, "BugAt")] / "train.log").read_text()
        assert "[ERROR] - job failed: bug in a callback at step 1\nTraceback" in job_log, job_log[-2000:]

    ok = jobs[(False, None)]
    assert int(ok.name) == 5  # the last job of the sweep (Hydra varies the last swept key fastest): every
    # failure before it was contained
    assert status(ok)["status"] == "completed" and report[ok.name].status == "completed"
    assert sorted(series(ok / "metrics.csv", "train/loss")) == [0, 1, 2, 3]
    assert "run/failed" not in rows(ok / "metrics.csv")[0]


# ---------------------------------------------------------------------------------------------- kill and resume
def assert_same_run(run_dir: Path, reference: Path) -> None:
    """The resumed run's metrics.csv and final weights equal the uninterrupted run's: exactly, as written (on a CPU
    with the same seed the computation is deterministic; the data order, the LR schedule, the optimizer state and
    the RNG states all come back from the checkpoint)."""
    for key in ("train/loss", "lr-AdamW", "val/loss", "sink/alpha1", "act/massive_ratio"):
        got, want = series(run_dir / "metrics.csv", key), series(reference / "metrics.csv", key)
        assert got == want, key
    assert sorted(series(run_dir / "metrics.csv", "train/loss")) == list(range(8))
    a, b = weights(run_dir / "checkpoints" / "last.ckpt"), weights(reference / "checkpoints" / "last.ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.ci
def test_sigkill_then_resume_equals_an_uninterrupted_run(reference, corpus, tmp_path):
    """SIGKILL at the start of step 6 (last.ckpt holds step 4; metrics.csv already has rows of steps 4 and 5),
    then `ckpt_path=last`: the losses logged after the resume, the metrics.csv rows and the final weights equal the
    uninterrupted run's."""
    marker = tmp_path / "at-step-6"
    stall = ["+callbacks.stall._target_=tests.helpers.faults.StallAt", "+callbacks.stall.step=6",
             f"+callbacks.stall.marker='{marker}'"]
    proc = start_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus), *stall, warnings="ignore")
    wait_for(marker, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 4
    assert max(series(tmp_path / "metrics.csv", "train/loss")) == 5  # rows of the steps to be trained again
    assert status(tmp_path)["status"] == "running"  # what a hard kill leaves; the report calls it stalled later
    run_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus), "ckpt_path=last", check=True)
    assert status(tmp_path)["status"] == "completed"
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
@pytest.mark.ci
def test_sigterm_saves_stops_and_requeued_job_resumes(reference, corpus, tmp_path):
    """SIGTERM (pre-emption, scancel) while step 5 runs: step 5 finishes, last.ckpt is saved at step 6, the run
    exits 143 with status "preempted"; the requeued job (ckpt_path=auto) resumes there and ends as the
    uninterrupted run does."""
    marker = tmp_path / "at-step-5"
    stall = ["+callbacks.stall._target_=tests.helpers.faults.StallAt", "+callbacks.stall.step=5",
             f"+callbacks.stall.marker='{marker}'", "+callbacks.stall.seconds=120"]
    proc = start_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus), *stall, warnings="ignore")
    wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    lines = error_lines(err)
    assert lines[-1].startswith("preempted: SIGTERM received: stopped after step 6, saved ") and \
        lines[-1].endswith("last.ckpt; resume with ckpt_path=auto (or ckpt_path=last)"), lines
    assert "Traceback" not in err
    assert read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 6
    st = status(tmp_path)
    assert st["status"] == "preempted" and st["step"] == 6
    run_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus), "ckpt_path=auto", check=True)
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_submitit_usr2_saves_then_hands_over_to_the_requeue_handler(corpus, tmp_path, capsys):
    """submitit sends SIGUSR2 before the time limit; its handler (installed before training) requeues the job. Here
    a stand-in handler records the call: sinklab saves last.ckpt first, then calls it, then exits 140."""
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append((signum, (tmp_path / "checkpoints" /
                                                                                          "last.ckpt").exists())))
    try:
        code, _, err = run_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus), "trainer.max_steps=4",
                               "+callbacks.usr2._target_=tests.helpers.faults.SignalAt", "+callbacks.usr2.step=1",
                               "+callbacks.usr2.signum=SIGUSR2", capsys=capsys)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert code == 128 + signal.SIGUSR2
    assert calls == [(signal.SIGUSR2, True)]  # called once, after the checkpoint was written
    assert read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 2
    assert status(tmp_path)["status"] == "preempted"
    assert "preempted: SIGUSR2 received: stopped after step 2" in err


@pytest.mark.slow
@pytest.mark.ci
def test_completed_slurm_job_ignores_a_late_time_limit_warning(corpus, tmp_path):
    """A job whose training completed must not die of submitit's SIGUSR2 on its way out: Python puts every handler
    back to the default while it exits, and SIGUSR2's default ends the process, so SLURM would mark the finished job
    FAILED (seen on a real SLURM). In a submitit SLURM job the signal is ignored once training completed; elsewhere
    nothing changes, and the same late signal ends the process as it ends any program."""
    script = ("import os, signal, sys, time\n"
              "from sinklab.train.entry import main\n"
              "sys.argv[0] = 'sinklab-train'\n"
              "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
              "os.kill(os.getpid(), signal.SIGUSR2)\n"
              "time.sleep(0.5)\n"
              "print('survived')\n")
    args = [*small(corpus), "trainer.max_steps=2", "callbacks.sink.every_n_steps=2"]
    for executor, code in (("slurm", 0), (None, -signal.SIGUSR2)):
        env = {k: v for k, v in process_env(None, "ignore").items() if k != "SUBMITIT_EXECUTOR"}
        if executor:
            env["SUBMITIT_EXECUTOR"] = executor
        proc = subprocess.run([sys.executable, "-c", script, *args, f"paths.output_dir={tmp_path}/{executor}"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == code, (executor, proc.stderr[-3000:])
        assert status(tmp_path / str(executor))["status"] == "completed"
        assert ("survived" in proc.stdout) == (code == 0)
        assert ("SIGUSR2 (the time-limit warning) is ignored from here on" in proc.stderr + proc.stdout) == (code == 0)


@pytest.mark.slow
@pytest.mark.ci
def test_lightnings_slurm_requeue_is_off(corpus, tmp_path):
    """One requeue mechanism, submitit's (sinklab.train.fault): under SLURM, Lightning's own auto-requeue would catch
    SIGUSR1, save hpc_ckpt_1.ckpt in the middle of a step, call `scontrol requeue` and train on. It is off: SIGUSR1
    (not one of callbacks.preemption.signals) ends the process as it ends any program, and nothing is saved."""
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "1", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    usr1 = ["+callbacks.usr1._target_=tests.helpers.faults.SignalAt", "+callbacks.usr1.step=2",
            "+callbacks.usr1.signum=SIGUSR1"]
    proc = start_cli("sinklab-train", f"paths.output_dir={tmp_path}", *small(corpus), *usr1,
                     env={**os.environ, **slurm}, warnings="ignore")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGUSR1, err[-3000:]
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt"))
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # the first periodic one is due at step 4


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: its reference training is the default suite's only one (issue 35)
def test_ckpt_path_auto_takes_the_latest_checkpoint(reference, tmp_path, monkeypatch):
    """ckpt_path=auto: none -> a fresh start; else the checkpoint with the most steps among checkpoints/last.ckpt
    and Lightning's SLURM requeue checkpoints hpc_ckpt_N.ckpt (an unreadable one is never preferred). Under SLURM
    Lightning resumes from hpc_ckpt_N.ckpt even with ckpt_path=null: the entry names it, so that it is checked."""
    from sinklab.train.fault import resolve_ckpt_path

    assert resolve_ckpt_path("auto", tmp_path) is None
    ckpt = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=True)
    (tmp_path / "checkpoints").mkdir()
    torch.save(ckpt, tmp_path / "checkpoints" / "last.ckpt")  # step 8
    assert resolve_ckpt_path("auto", tmp_path) == str(tmp_path / "checkpoints" / "last.ckpt")
    torch.save({**ckpt, "global_step": 10}, tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_2.ckpt").write_bytes(b"PK\x03\x04 truncated")
    assert resolve_ckpt_path("auto", tmp_path) == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert resolve_ckpt_path(None, tmp_path) is None  # not under SLURM
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert resolve_ckpt_path(None, tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")  # Lightning's choice: the newest
    with pytest.raises(UserError, match="hpc_ckpt_2.ckpt is not a readable sinklab checkpoint"):
        from sinklab.runs.checkpoints import read_training_checkpoint

        read_training_checkpoint(resolve_ckpt_path(None, tmp_path))


# ---------------------------------------------------------------------------------------------- metrics.csv
def test_metrics_csv_of_a_resume_goes_on_from_the_checkpoint_step(tmp_path):
    """Lightning's own CSVLogger with sinklab.train.fault.continue_metrics: a resume at step 6 goes on with the rows
    of steps 0..5 exactly as written and the rows logged after them, one per step; a carry-over killed midway
    (metrics.csv.resume left, a half-written metrics.csv) is redone from the old file; a fresh run replaces the file."""
    from lightning.pytorch.loggers import CSVLogger

    from sinklab.train.fault import continue_metrics

    def logger(step):
        lg = CSVLogger(tmp_path, name="", version="")
        continue_metrics([lg], step)
        return lg

    first = logger(None)
    for step in range(10):
        first.log_metrics({"train/loss": 10.0 - step + 1e-9 * step}, step=step)
    first.log_metrics({"val/loss": 3.0}, step=9)
    first.save()
    before = rows(tmp_path / "metrics.csv")
    resumed = logger(6)
    for step in range(6, 8):
        resumed.log_metrics({"train/loss": 100.0 + step, "new/key": 1.0}, step=step)
    resumed.save()
    got = rows(tmp_path / "metrics.csv")
    assert [(int(r["step"]), float(r["train/loss"])) for r in got] == \
        [(s, 10.0 - s + 1e-9 * s) for s in range(6)] + [(6, 106.0), (7, 107.0)]
    assert [r["train/loss"] for r in got[:6]] == [r["train/loss"] for r in before[:6]]  # as written
    assert "new/key" in got[0] and "val/loss" not in got[0]  # the header: the keys of the rows kept and new
    assert not (tmp_path / "metrics.csv.resume").exists()

    (tmp_path / "metrics.csv").rename(tmp_path / "metrics.csv.resume")  # killed after the move ...
    (tmp_path / "metrics.csv").write_text("step,train/loss\n0,5")  # ... and during the first write
    logger(7).save()
    assert [(r["step"], r["train/loss"]) for r in rows(tmp_path / "metrics.csv")] == \
        [(r["step"], r["train/loss"]) for r in got[:7]]
    assert not (tmp_path / "metrics.csv.resume").exists()

    fresh = logger(None)  # no resume step: a new run replaces the file
    fresh.log_metrics({"train/loss": 1.0}, step=0)
    fresh.save()
    assert [r["train/loss"] for r in rows(tmp_path / "metrics.csv")] == ["1.0"]


# ---------------------------------------------------------------------------------------------- DDP
@pytest.mark.slow
@pytest.mark.ci
def test_ddp_cpu_matches_a_single_process_run(corpus, tmp_path):
    """trainer=ddp_cpu (2 processes, gloo) with data.batch_size=2 against one process with data.batch_size=4.

    The data module gives rank r of W the sample indices step*B*W + r*B + j (j < B) at each step: with W=2, B=2
    that is {4s, 4s+1} on rank 0 and {4s+2, 4s+3} on rank 1, the same four samples {4s..4s+3} the single process
    reads with B=4. DDP averages the two ranks' gradients, which equals the gradient of the mean loss over the
    four samples; clipping and AdamW then see the same gradient. So the weights after 3 steps agree to float
    rounding, and the sink metric, computed on rank 0 only, is logged once per measured step with the same value.
    """
    common = [*small(corpus), "trainer.max_steps=3", "trainer.val_check_interval=3",
              "callbacks.sink.every_n_steps=3", "callbacks.checkpoint.every_n_train_steps=3"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run_cli("sinklab-train", f"paths.output_dir={single}", *common, "data.batch_size=4", check=True)
    run_cli("sinklab-train", f"paths.output_dir={ddp}", *common, "data.batch_size=2", "trainer=ddp_cpu", check=True)
    a, b = weights(single / "checkpoints" / "last.ckpt"), weights(ddp / "checkpoints" / "last.ckpt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert read_checkpoint(ddp / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert status(ddp)["status"] == "completed" and status(ddp)["step"] == 3
    sink_single, sink_ddp = series(single / "metrics.csv", "sink/alpha1"), series(ddp / "metrics.csv", "sink/alpha1")
    assert sorted(sink_ddp) == sorted(sink_single) == [3]  # once (series() refuses a step logged twice)
    assert float(sink_ddp[3]) == pytest.approx(float(sink_single[3]), rel=1e-4)
    val_single, val_ddp = series(single / "metrics.csv", "val/loss"), series(ddp / "metrics.csv", "val/loss")
    assert float(val_ddp[2]) == pytest.approx(float(val_single[2]), rel=1e-4)  # sync_dist mean over the ranks
