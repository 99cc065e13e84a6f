"""The SLURM launcher scheduled for real: a one-node SLURM started by scripts/slurm_local.sh, a sweep of two jobs
submitted by `sinklab-train -m` with the launcher settings of the docs' local-cluster command (hydra/launcher=slurm),
and what SLURM does to them:

    job 0  requeued mid-run with `scontrol requeue` (SIGTERM): saves last.ckpt, resumes from it (ckpt_path=auto)
    job 1  reaches its 1-minute time limit: SLURM sends SIGUSR2 signal_delay_s before it, submitit requeues it

Both train the same model with the same seed as an uninterrupted reference run, so every row of their metrics.csv
(perf/* timings aside) must equal the reference's. A test callback paces each training step to PACE_S seconds (a
sleep: the 2 cores stay free), so that a job of 300 steps outlasts SLURM's shortest time limit, one minute.

Marked `slurm` (and `slow`, so that the default `-m "not slow"` run leaves it out): `python -m pytest -m slurm -q`,
about 3 minutes. Needs root (the script installs slurm-wlm and munge with apt-get when missing); skipped, with the
script's one-line reason, only where they cannot be installed.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import HYDRA_SCHEMA_WARNING, REPO, readme_commands, rows, run_cli, series, small, start_cli

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = REPO / "scripts" / "slurm_local.sh"
CANNOT_RUN_HERE = 3  # the script's exit code when this machine cannot run the local SLURM (no packages, no root)
STEPS = 300
PACE_S = 0.2
TIME_LIMIT_MIN = 1  # SLURM's shortest
SIGNAL_DELAY_S = 5  # SLURM checks time limits every 30 s: the USR2 comes 5 to 35 s before the limit
TRAINING = [f"trainer.max_steps={STEPS}", "trainer.val_check_interval=100", "callbacks.sink.every_n_steps=100",
            "callbacks.checkpoint.every_n_train_steps=50", "optim.warmup_steps=10", "peak_flops=null"]
REQUEUE_AFTER_STEP = 60  # past the periodic checkpoint of step 50: the resume must come from the SIGTERM's save
SWEEP_TIMEOUT_S = 480


# ---------------------------------------------------------------------------------------------- the cluster
def free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld, slurmd): another SLURM on this machine is left alone."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise AssertionError("no two free consecutive ports")


def script(*args: str, port: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SLURM_LOCAL_PORT": str(port)})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node SLURM for this module, started and stopped by scripts/slurm_local.sh; its SLURM_CONF."""
    home, port = tmp_path_factory.mktemp("slurm"), free_port_pair()
    started = script("start", str(home), port=port)
    last_line = (started.stderr.strip().splitlines() or [""])[-1]
    if started.returncode == CANNOT_RUN_HERE:
        pytest.skip(last_line)
    assert started.returncode == 0, started.stdout + started.stderr
    exports = re.findall(r"^export SLURM_CONF=(\S+)$", started.stdout, re.M)
    assert exports == [str(home / "slurm.conf")], started.stdout
    try:
        yield exports[0]
    finally:
        stopped = script("stop", str(home), port=port)
        assert stopped.returncode == 0, stopped.stderr
        assert script("status", str(home), port=port).returncode == 1  # every daemon gone


def slurm_cmd(conf: str, *args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, "SLURM_CONF": conf}).stdout


def job_field(conf: str, job: str, field: str) -> str:
    return re.search(rf"\b{field}=(\S+)", slurm_cmd(conf, "scontrol", "show", "job", job)).group(1)


# ---------------------------------------------------------------------------------------------- the sweep
def readme_launcher_args() -> list[str]:
    """The launcher settings of the documentation's local-cluster sweep (docs/how-to/sweeps.md, "Sweeps on SLURM")."""
    line = next(c for c in readme_commands() if "hydra/launcher=slurm" in c and "gpus_per_node=0" in c)
    keep = ("hydra/launcher=", "hydra.launcher.", "trainer=", "ckpt_path=")
    return [a for a in shlex.split(line)[1:] if a.startswith(keep)]


def job_env(conf: str) -> dict[str, str]:
    """This process's environment (the jobs inherit it through sbatch) with the test callbacks importable; Python's
    warnings are left on, so that a deprecation warning would show."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return {**env, "SLURM_CONF": conf, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def wait(what: str, check, proc: subprocess.Popen, timeout: float = 180.0):
    """Poll `check()` until it returns something true, while the sweep runs."""
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the sweep exited ({proc.returncode}) before {what}:\n{out[-3000:]}\n{err[-3000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.5)


def array_task(conf: str, index: int) -> str | None:
    ids = slurm_cmd(conf, "squeue", "-h", "-o", "%i").split()
    return next((i for i in ids if i.endswith(f"_{index}")), None)


def last_step(metrics: Path) -> int:
    """The last step with a train/loss row (-1 before any; the file is being written)."""
    try:
        return max(series(metrics, "train/loss"), default=-1)
    except (OSError, ValueError, KeyError):
        return -1


def submitit_log(job_dir: Path, name: str, kind: str) -> str:
    """What submitit's job `name` (e.g. 12_0) wrote to its stdout or stderr, over all its runs."""
    return (job_dir / name / f"{name}_0_log.{kind}").read_text()


def submitit_events(log: str, message: str) -> list[datetime]:
    """The times of submitit's log lines that start with `message`."""
    pattern = rf"^submitit \w+ \((\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\) - {re.escape(message)}"
    return [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in re.findall(pattern, log, re.M)]


@pytest.fixture(scope="module")
def sweep(cluster, corpus, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("slurm-sweep")
    common = small(corpus, *TRAINING)
    reference = root / "reference"
    ref = run_cli("sinklab-train", f"paths.output_dir={reference}", *common, process=True, env=job_env(cluster),
                  timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    sweep_dir = root / "multirun"
    args = ["-m", *readme_launcher_args(), f"hydra.launcher.timeout_min={TIME_LIMIT_MIN}",
            f"hydra.launcher.signal_delay_s={SIGNAL_DELAY_S}", *common, "+callbacks.pace._target_=tests.helpers.faults.Pace",
            f"+callbacks.pace.seconds={PACE_S}", "tags=[requeue],[timelimit]", f"hydra.sweep.dir={sweep_dir}"]
    proc = start_cli("sinklab-train", *args, env=job_env(cluster))
    try:
        # job 0 is the one to requeue: time enough for it, so that only job 1 meets its time limit
        job0 = wait("job 0 in the queue", lambda: array_task(cluster, 0), proc)
        slurm_cmd(cluster, "scontrol", "update", f"JobId={job0}", "TimeLimit=15")
        metrics0 = sweep_dir / "0" / "metrics.csv"
        wait(f"job 0 at step {REQUEUE_AFTER_STEP}", lambda: last_step(metrics0) >= REQUEUE_AFTER_STEP, proc)
        slurm_cmd(cluster, "scontrol", "requeue", job0)
        job1 = job0.rsplit("_", 1)[0] + "_1"
        out, err = proc.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    report = run_cli("sinklab", "report", str(sweep_dir), process=True, env=job_env(cluster), timeout=300)
    jobs = [SimpleNamespace(dir=sweep_dir / str(i), name=name, state=job_field(cluster, name, "JobState"),
                            restarts=int(job_field(cluster, name, "Restarts")),
                            out=submitit_log(sweep_dir / ".submitit", name, "out"),
                            err=submitit_log(sweep_dir / ".submitit", name, "err"))
            for i, name in enumerate((job0, job1))]
    return SimpleNamespace(proc=proc, out=out, err=err, dir=sweep_dir, reference=reference, jobs=jobs,
                           report=report)


def without_timings(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows(path)]


def assert_same_as_reference(job, reference: Path) -> None:
    """No step lost or logged twice (series() refuses a step twice), and every row as the uninterrupted run's."""
    assert sorted(series(job.dir / "metrics.csv", "train/loss")) == list(range(STEPS))
    got, want = without_timings(job.dir / "metrics.csv"), without_timings(reference / "metrics.csv")
    assert got == want, f"{job.name}: metrics.csv differs from the uninterrupted run's"


# ---------------------------------------------------------------------------------------------- the checks
def test_both_jobs_complete(sweep):
    assert sweep.proc.returncode == 0, sweep.err[-3000:]
    for job in sweep.jobs:
        assert job.state == "COMPLETED", (job.name, job.err[-3000:])
        status = (job.dir / "status.json").read_text()
        assert '"status": "completed"' in status and f'"step": {STEPS}' in status, status


def test_requeued_job_resumes_from_its_checkpoint_without_losing_or_repeating_a_step(sweep):
    job = sweep.jobs[0]
    assert job.restarts == 1
    stopped = re.findall(r"^preempted: SIGTERM received: stopped after step (\d+), saved (\S+);", job.err, re.M)
    assert len(stopped) == 1, job.err[-3000:]
    step, path = stopped[0]
    assert int(step) > REQUEUE_AFTER_STEP and path == str(job.dir / "checkpoints" / "last.ckpt")
    assert f"resuming from {path} (step {step})" in job.out
    assert len(submitit_events(job.out, "Starting with JobEnvironment")) == 2
    assert_same_as_reference(job, sweep.reference)


def test_job_at_its_time_limit_gets_usr2_before_it_and_is_requeued(sweep):
    job = sweep.jobs[1]
    submission = next((sweep.dir / ".submitit").glob("*/*_submission.sh")).read_text().splitlines()
    assert f"#SBATCH --time={TIME_LIMIT_MIN}" in submission
    assert f"#SBATCH --signal=USR2@{SIGNAL_DELAY_S}" in submission
    starts = submitit_events(job.out, "Starting with JobEnvironment")
    signals = submitit_events(job.out, "Caught signal SIGUSR2")
    requeues = submitit_events(job.out, f"Requeued job {job.name}")
    assert signals and len(requeues) == len(signals) == job.restarts == len(starts) - 1, job.out[-3000:]
    for start, signal_at in zip(starts, signals):
        ran = (signal_at - start).total_seconds()
        assert 0 < ran <= TIME_LIMIT_MIN * 60 - SIGNAL_DELAY_S + 1, f"SIGUSR2 {ran:.1f} s after the run started"
    # sinklab saved each time before handing the signal to submitit, and the next run resumed there
    saved = re.findall(r"^preempted: SIGUSR2 received: stopped after step (\d+), saved ", job.err, re.M)
    assert len(saved) == len(signals)
    for step in saved:
        assert f"checkpoints/last.ckpt (step {step})" in job.out
    assert "this job is timed-out" in job.err
    assert_same_as_reference(job, sweep.reference)


def test_report_shows_every_job_completed(sweep):
    assert sweep.report.returncode == 0, sweep.report.stderr
    assert "2 jobs (completed 2)" in sweep.report.stdout
    table = rows(sweep.dir / "report" / "report.csv")
    assert [(r["job"], r["status"], r["steps"]) for r in table] == [("0", "completed", str(STEPS)),
                                                                    ("1", "completed", str(STEPS))]


def test_no_hydra_deprecation_warning(sweep):
    """The preset extends the plugin's schema: Hydra's "automatic schema matching" warning is printed neither when
    the sweep is composed nor when each job composes its config again."""
    for text in (sweep.out, sweep.err, *(j.out + j.err for j in sweep.jobs)):
        assert HYDRA_SCHEMA_WARNING not in text
