"""Shared fixtures (the helpers they and the tests use live in tests/helpers). The tests mirror the source tree:
tests/model, metrics, data, train, evals, config, report, cli, integration; tests/golden holds the numbers that must
not change and their checks."""
import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "HF_MODULES_CACHE" not in os.environ:  # the remote code transformers imports (sinklab's exports): this session's
    import atexit  # own directory, set before transformers reads it (once, on import), inherited by subprocesses
    import shutil
    import tempfile

    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="sinklab-tests-hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], True)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: N workers share the cores, one thread each (and the
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # trainings they start in subprocesses)

from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from sinklab.contracts.component_checks import flex_on_cpu as contract_flex_on_cpu  # noqa: E402
from sinklab.model import ModelConfig, Transformer  # noqa: E402
from tests.helpers import HF_KINDS, natural_run, save_ckpt, tiny_hf, train, write_corpus  # noqa: E402


@pytest.fixture
def flex_on_cpu():
    """FlexAttention with gradients on the CPU (sinklab.contracts.component_checks.flex_on_cpu, shared with `sinklab
    check-component`); yields the list of its calls."""
    with contract_flex_on_cpu() as calls:
        yield calls


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """A run dir (local corpus, BPE 300, blocks of 32, 2 validation blocks, a probe set of 10 x 16) with a random
    2-layer d 32 model in checkpoints/last.ckpt: (run dir, its data module, the model)."""
    try:
        from sinklab.data import LMDataModule  # noqa: F401
    except ImportError as err:
        pytest.skip(f"sinklab.data.LMDataModule is not available ({err})")
    run, dm = natural_run(tmp_path_factory.mktemp("small_run"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=dm.vocab_size, n_layer=2, n_head=4, d_model=32, d_ff=64,
                                    block_size=32)).eval()
    save_ckpt(model, run / "checkpoints" / "last.ckpt")
    return run, dm, model


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A real short default run, shared by the sampling, streaming, trajectory and atlas browser tests: `sinklab-train` with FAST for
    120 steps (Shakespeare, 1024 BPE with a BOS token at position 1, a 2-layer d 64 model of context 64, RoPE; ~20
    s), the sink measured every 20 steps, checkpoints kept at steps 16, 29, 51, 90 (scale=quick's log-spaced
    schedule at 1024 tokens per step) and every 40. At 40 steps greedy decoding repeats one token, which would hide
    a decoding bug."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(out, "trainer.max_steps=120", "callbacks.checkpoint.keep.every_n_steps=40")
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six small text documents and a shared token cache (the reliability and SLURM tests' small runs)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random transformers models of every family of HF_KINDS (2 layers, d 32, vocabulary 128, context 64;
    tests/helpers/hf_models.py), each saved once with a word-level tokenizer beside it: {kind: dir}."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_models")
    return {kind: tiny_hf(kind, root / kind, tokenizer=True) for kind in HF_KINDS}


# How `pytest -n N` shares the work (pytest-xdist, --dist loadfile and --no-loadscope-reorder in pyproject.toml): in
# units of whole files, so that a file's module fixtures are built once, handed out in the collection's order below,
# a worker taking the next unit when it has two tests left. Files that share an expensive session fixture are one unit,
# so that one worker builds it: `trained_run`, a 120-step training (~20 s).
ONE_UNIT = {"trained_run": ("tests/evals/test_streaming.py", "tests/evals/test_trajectory.py",
                            "tests/metrics/test_metric_contracts.py", "tests/evals/test_sample.py",
                            "tests/evals/test_atlas_browser.py")}
# The units that take longest in the default suite (compositions, training runs, subprocesses: ~5 s to ~90 s each on
# a 2-core machine), longest first; the others follow, most tests first. (xdist's own order, most tests first, put the
# long files of a few tests each last, where one worker ran them while the other had nothing left.)
LONGEST_FIRST = (
    "tests/config/test_experiments.py", "trained_run", "tests/model/test_contracts.py", "tests/golden/test_golden.py",
    "tests/cli/test_readme.py", "tests/train/test_reliability.py", "tests/model/test_model_zoo.py",
    "tests/report/test_seed_statistics.py", "tests/report/test_report.py", "tests/evals/test_measure.py",
    "tests/data/test_prepare.py", "tests/train/test_train.py", "tests/metrics/test_bounds.py",
    "tests/data/test_data_config.py", "tests/model/test_backends.py", "tests/metrics/test_gate_metrics.py",
    "tests/cli/test_layering.py", "tests/integration/test_default_run.py", "tests/data/test_data_controls.py",
    "tests/evals/test_quant.py", "tests/data/test_data.py",
)
_UNIT_OF_FILE = {file: unit for unit, files in ONE_UNIT.items() for file in files}


def unit_of(nodeid: str) -> str:
    """The unit of work a test is handed out in: its file, or the ONE_UNIT group its file is in."""
    file = nodeid.split("::", 1)[0]
    return _UNIT_OF_FILE.get(file, file)


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselected what they deselect
def pytest_collection_modifyitems(items):
    """The units in the order of LONGEST_FIRST, then the others, most tests first; within a unit the collected order
    is kept (a file's tests stay together)."""
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    tests = Counter(unit_of(item.nodeid) for item in items)
    items.sort(key=lambda item: (rank.get(unit := unit_of(item.nodeid), len(rank)), -tests[unit], unit))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of a ONE_UNIT group as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Scheduling(config, log)
