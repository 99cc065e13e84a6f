"""sinklab on a stock GPU image (issue 39), which has torch, Lightning and transformers but not `datasets`, wandb,
submitit or hydra-submitit-launcher: a run from a directory made by `sinklab prepare` elsewhere trains with the CSV
logger (the default) and is measured, and an option that needs one of the missing packages is refused in one line
that names the option and the package, before any compute.

The subprocesses here cannot import those packages (a sitecustomize.py on PYTHONPATH puts a finder first on
sys.meta_path that reports them missing); everything else, and the corpus preparation in this process, uses the real
installation."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.helpers import assert_one_line_error, rows, run_cli, run_cli_in_one_process, write_corpus

# a corpus prepared and a run trained in subprocesses (~20 s): after the default suite, in CI's `ci` tier
pytestmark = [pytest.mark.slow, pytest.mark.ci]

MISSING = ("datasets", "wandb", "submitit", "hydra_plugins")  # top-level modules; hydra_plugins: the launcher plugin

SITECUSTOMIZE = f'''"""The packages MISSING cannot be imported in this Python, as on an image where they are not installed."""
import sys

MISSING = {MISSING!r}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None  # the other finders look for it as usual


sys.meta_path.insert(0, NotInstalled())
'''

# a 2-layer model trained for 10 steps on the prepared blocks, validated and probed for sinks twice
TINY = ["model.n_layer=2", "model.d_model=64", "model.d_ff=128", "data.batch_size=8", "trainer.max_steps=10",
        "trainer.val_check_interval=5", "trainer.limit_val_batches=2", "callbacks.sink.every_n_steps=5",
        "callbacks.checkpoint.every_n_train_steps=5", "optim.warmup_steps=2", "trainer.enable_progress_bar=false"]
# the options that need a missing package: (the override, the one line's option, its package); a launcher's in a
# multirun (-m)
NEEDS = {
    "slurm": ("hydra/launcher=slurm", "hydra/launcher=slurm", "hydra-submitit-launcher"),
    "local": ("hydra/launcher=local", "hydra/launcher=local", "hydra-submitit-launcher"),
    "submitit_slurm": ("hydra/launcher=submitit_slurm", "hydra/launcher=submitit_slurm", "hydra-submitit-launcher"),
    "wandb": ("logger=wandb", "logger=wandb", "wandb"),
    "corpus": ("data.prepared_dir=null", "data.corpus=local", "datasets"),  # the files, not the prepared dir
}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A prepared directory (made here, with `datasets`) and the environment of a Python without MISSING."""
    root = tmp_path_factory.mktemp("stock_image")
    corpus = write_corpus(root)
    prepared = root / "prepared"
    run_cli("sinklab", "prepare", "--files", *corpus.files, "--vocab-size", "300", "--num-proc", "1", "--no-progress",
            "--out", str(prepared), check=True)
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(site)}  # run_cli puts this checkout before it
    data = ["data=local", f"data.prepared_dir={prepared}", "data.files=[" + ",".join(corpus.files) + "]",
            f"data.cache_dir={corpus.cache}"]
    return SimpleNamespace(root=root, prepared=prepared, env=env, data=data)


@pytest.fixture(scope="module")
def ran(image):
    """sinklab-train in one subprocess without MISSING: each option of NEEDS (its own output dir), then the run."""
    names = [*NEEDS, "run"]
    calls = [[*(["-m"] if override.startswith("hydra/launcher") else []), *image.data, *TINY, override,
              f"paths.output_dir={image.root / name}", f"hydra.sweep.dir={image.root / name}"]
             for name, (override, _, _) in NEEDS.items()]
    calls.append([*image.data, *TINY, f"paths.output_dir={image.root / 'run'}"])
    return dict(zip(names, run_cli_in_one_process("sinklab-train", calls, env=image.env, warnings="ignore")))


def test_the_packages_are_missing_in_the_subprocesses(image):
    """The check itself: the subprocesses' Python cannot import MISSING, and imports the rest."""
    probe = ("import importlib, json\n"
             "def imports(name):\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "        return True\n"
             "    except ModuleNotFoundError:\n"
             "        return False\n"
             f"print(json.dumps({{n: imports(n) for n in {MISSING!r} + ('yaml', 'tokenizers', 'sinklab')}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=image.env, check=True)
    assert json.loads(out.stdout) == {**{name: False for name in MISSING}, "yaml": True, "tokenizers": True,
                                      "sinklab": True}


def test_a_prepared_run_trains_with_the_csv_logger_and_is_measured(image, ran):
    run = image.root / "run"
    assert ran["run"].returncode == 0, ran["run"].stderr[-3000:]
    assert "done: 10 steps, val/loss" in ran["run"].stdout + ran["run"].stderr
    logged = rows(run / "metrics.csv")
    assert any(r.get("val/loss") for r in logged) and any(r.get("sink/sink1") for r in logged)
    measured = run_cli("sinklab", "measure", str(run), "--json", process=True, env=image.env, warnings="ignore",
                       check=True)
    result = json.loads(measured.stdout)
    assert result["target"] == str(run / "checkpoints" / "last.ckpt")
    assert len(result["alpha"]) == 2 and 0 <= result["sink"]["1"] <= 1  # a layer x head table, a fraction


@pytest.mark.parametrize("name", NEEDS)
def test_an_option_needing_a_missing_package_is_one_line(image, ran, name):
    """hydra/launcher=slurm|local (and the plugin's names) without hydra-submitit-launcher, logger=wandb without wandb,
    a corpus read from its files without datasets: one line naming the option and `pip install PACKAGE`, exit 2,
    and nothing trained (no metrics.csv, no checkpoint)."""
    _, option, package = NEEDS[name]
    assert ran[name].returncode == 2
    assert_one_line_error(ran[name].stderr, f"error: {option} needs {package}", f"pip install {package}",
                          starts="error: ", logs=True)
    assert not (image.root / name / "metrics.csv").exists()
    assert not list(image.root.glob(f"{name}/**/*.ckpt"))
