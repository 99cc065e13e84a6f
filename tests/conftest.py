"""Shared fixtures and helpers: small models, token batches, and the configurations that select every registered
component (the generic contract tests run over them)."""
import os
import random
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# the generic contract checks' models, tokens and cases, shared with `sinklab check-component`
from sinklab.contracts.components import (SMALL, case_id, component_cases, small_model,  # noqa: E402, F401
                                          token_ids)
from sinklab.contracts.components import explicit_paths  # noqa: E402
from sinklab.contracts.components import flex_on_cpu as contract_flex_on_cpu  # noqa: E402
from sinklab.model import ModelConfig, Transformer  # noqa: E402

# a fast real training run (tests/test_train.py and the runs the evaluation tests train): 2 layers, d 64
FAST = ["model.n_layer=2", "model.d_model=64", "model.d_ff=128", "data.batch_size=16",
        "trainer.val_check_interval=20", "trainer.limit_val_batches=4", "callbacks.sink.every_n_steps=20",
        "callbacks.checkpoint.every_n_train_steps=20", "optim.warmup_steps=5", "trainer.enable_progress_bar=false"]
WORDS = ["".join(random.Random(i).choice("etaoinshrdlucmfwypvbgk") for _ in range(1 + i % 8)) for i in range(300)]


def explicit_logits(m: Transformer, idx: torch.Tensor) -> torch.Tensor:
    """The logits with every layer through its explicit maps (the fused kernels off for this forward)."""
    with explicit_paths(m):
        return m(idx)


def layer_records(m: Transformer, idx: torch.Tensor, explicit: bool = False) -> list[dict]:
    """Per layer, q, k, v as the operation sees them (after RoPE, with bias slots and sink tokens) and the block
    output h (the residual stream, sink tokens first), recorded by forward hooks on the model's hook points."""
    layers: list[dict] = [{} for _ in m.blocks]
    handles = []
    for rec, block in zip(layers, m.blocks):
        for name, point in (("q", block.attn.hook_q), ("k", block.attn.hook_k), ("v", block.attn.hook_v),
                            ("h", block.hook_resid)):
            handles.append(point.register_forward_hook(lambda _m, _i, out, rec=rec, name=name: rec.update({name: out})))
    try:
        with explicit_paths(m, explicit):
            m(idx)
    finally:
        for h in handles:
            h.remove()
    return layers


def fake_text(seed: int, n_words: int) -> str:
    """Deterministic pseudo-prose with a Zipf-like word distribution (corpora for the data tests)."""
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        line.append(WORDS[min(int(rng.paretovariate(1.0)) - 1, len(WORDS) - 1)] if rng.random() < 0.7
                    else rng.choice(WORDS))
        if rng.random() < 0.12:
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    return "\n".join(lines) + "\n"


@pytest.fixture
def flex_on_cpu():
    """FlexAttention with gradients on the CPU (sinklab.contracts.components.flex_on_cpu); yields the list of its
    calls."""
    with contract_flex_on_cpu() as calls:
        yield calls


@pytest.fixture
def make_model():
    return small_model


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """A run dir (local corpus, BPE 300, blocks of 32, 2 validation blocks, a probe set of 10 x 16) with a random
    2-layer d 32 model in checkpoints/last.ckpt: (run dir, its data module, the model)."""
    try:
        from sinklab.data import LMDataModule  # noqa: F401
    except ImportError as err:
        pytest.skip(f"sinklab.data.LMDataModule is not available ({err})")
    from test_measure import natural_run, save_ckpt

    run, dm = natural_run(tmp_path_factory.mktemp("small_run"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=dm.vocab_size, n_layer=2, n_head=4, d_model=32, d_ff=64,
                                    block_size=32)).eval()
    save_ckpt(model, run / "checkpoints" / "last.ckpt")
    return run, dm, model


def train(out: Path, *overrides: str, check: bool = True, warnings: str = "ignore") -> subprocess.CompletedProcess:
    """`sinklab-train paths.output_dir=OUT` with FAST and `overrides`, in a subprocess as a user runs it."""
    cmd = [sys.executable, "-m", "sinklab.train.entry", f"paths.output_dir={out}", *FAST, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": warnings})
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A real short default run, shared by the sampling and streaming tests: `sinklab-train` with FAST for 120 steps
    (Shakespeare, 1024 BPE with a BOS token at position 1, a 2-layer d 64 model of context 64, RoPE; ~20 s). At 40
    steps greedy decoding repeats one token, which would hide a decoding bug."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(out, "trainer.max_steps=120")
    return out


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_cli_lines(prefix: str, paths: dict[str, Path]) -> list[list[str]]:
    """The README's lines starting with `prefix` (e.g. "sinklab sample "), comments stripped, as the arguments after
    `sinklab`; the placeholder paths of the README (keys of `paths`, e.g. runs/a) replaced by the test's."""
    import shlex

    lines = [line.split("  #", 1)[0].strip() for line in README.read_text().splitlines() if line.startswith(prefix)]
    return [[str(paths.get(a, a)) for a in shlex.split(line)[1:]] for line in lines]


def run_sinklab(capsys, *args: str) -> tuple[int, str, str]:
    """`sinklab ARGS...` in this process: (exit code, stdout, stderr); argparse's usage errors exit too."""
    from sinklab.cli import main

    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err
