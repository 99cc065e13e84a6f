"""The GPU check's shell scripts on the CPU: their one-line refusals, and `pack`, which turns a folder of step logs
into the few files a short-lived GPU machine can return (a summary line per figure, the logs without checkpoints).
The steps themselves need CUDA (docs/performance.md, "GPU"); the `paper` step runs on the CPU in the rehearsal."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_gpu_check_refuses_a_prepared_dir_without_a_manifest(tmp_path):
    r = bash("scripts/gpu_check.sh", str(tmp_path / "dest"), str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "PREPARED_DIR" in r.stderr and "sinklab prepare" in r.stderr
    assert not (tmp_path / "dest").exists()  # refused before anything ran or was written


def test_gpu_checks_refuses_an_unknown_step_naming_the_allowed_ones(tmp_path):
    r = bash("scripts/gpu_checks.sh", str(tmp_path / "logs"), "bench-nope")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "bench-nope" in r.stderr and "softmax_sdpa" in r.stderr


def test_pack_writes_a_summary_line_per_figure_and_the_logs_without_checkpoints(tmp_path):
    logs, dest = tmp_path / "logs", tmp_path / "dest"
    (logs / "paper_run" / "checkpoints").mkdir(parents=True)
    (logs / "paper_run" / "checkpoints" / "last.ckpt").write_bytes(b"\0" * 1024)
    (logs / "steps.txt").write_text("== bench_softmax_sdpa: exit 0 in 80 s (limit 110 s)\n")
    (logs / "bench_softmax_sdpa.log").write_text(
        "compiling...\ntrain tokens/s sinklab: 326,196  (median of 8 steps)\nMFU sinklab: 38.4% of the measured peak\n"
        "noise line\n")
    (logs / "paper_measure.log").write_text('{"sink": {"1": 0.0}}\n')
    r = bash("scripts/gpu_checks.sh", str(logs), "pack", str(dest))
    assert r.returncode == 0, r.stderr
    summary = (dest / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("== bench_softmax_sdpa: exit 0")
    assert "bench_softmax_sdpa: train tokens/s sinklab: 326,196  (median of 8 steps)" in summary
    assert "bench_softmax_sdpa: MFU sinklab: 38.4% of the measured peak" in summary
    assert 'paper_measure: {"sink": {"1": 0.0}}' in summary
    assert not any("noise" in line or "compiling" in line for line in summary)
    with tarfile.open(dest / "logs.tgz") as tar:
        names = tar.getnames()
    assert "./bench_softmax_sdpa.log" in names and not any(n.endswith(".ckpt") for n in names)
    assert sorted(p.name for p in dest.iterdir()) == ["logs.tgz", "summary.txt"]
