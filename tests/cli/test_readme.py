"""Keep the README true: every `sinklab-train` command line in README.md composes and passes the training entry's
validation, job by job for sweeps (`-m`), without training. The commands that really train (the default run, the
resume pair, `sinklab measure` / `report` / `export-hf`, the local-SLURM sweep) are run by tests/train/test_train.py,
tests/evals/test_measure.py, tests/report/test_report.py, tests/model/test_export_hf.py, tests/train/test_slurm.py
and .ci/run; this file checks the rest as a user would type them.
"""
from __future__ import annotations

import copy
import re
import shlex

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from sinklab.config import compose, validate_config
from tests.helpers import README, configs, readme_commands
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


def test_the_readme_shows_the_commands_users_rely_on():
    commands = readme_commands()
    assert any(c == "sinklab-train" for c in commands), "the default run is missing from the README"
    assert any(" -m " in c and "experiment=" in c for c in commands)
    assert any("hydra/launcher=slurm" in c and "partition=" in c for c in commands)
    assert any("hydra/launcher=slurm" in c and "gpus_per_node=0" in c for c in commands)  # tests/train/test_slurm.py
    assert any("logger=wandb" in c for c in commands)


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


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_training_command_composes_and_validates(command):
    for job, cfg in validated_jobs(command):
        for override in job:  # each key the user typed reaches the config
            key, _, value = override.partition("=")
            key = key.lstrip("+~")
            if "/" in key or key.startswith("hydra") or key in ("experiment", "model", "data", "scale", "logger"):
                continue
            assert OmegaConf.select(cfg, key, default="<absent>") != "<absent>", (command, override)


def readme_switch_groups() -> list[str]:
    """`model/<group>=<a>,<b>` entries of the README's switch table: each option as `model/<group>=<option>`, with
    the `model.key=value` overrides written beside it in the same backticks (`model/layers=gemma3 model.n_layer=6`)."""
    import re

    found = []
    for line in README.read_text().splitlines():
        if line.startswith("|"):
            for group, options, extra in re.findall(r"`model/(\w+)=([\w,]+)((?: model\.\w+=\w+)*)`", line):
                found += [f"model/{group}={o}{extra}" for o in options.split(",")]
    return found


@pytest.mark.parametrize("override", readme_switch_groups())
def test_every_readme_switch_group_option_composes(override):
    """The table's config-group column names real files (tests/model/test_model_zoo.py composes each file, checks
    that its keys reach the model config and trains a step); an option written with model keys beside it composes
    with them into a config the training entry accepts."""
    choice, *extra = override.split()
    group, option = choice.removeprefix("model/").split("=")
    assert (README.parent / "conf" / "model" / group / f"{option}.yaml").is_file(), override
    if extra:
        cfg = compose(override.split())
        validate_config(cfg)
        for key, value in (o.split("=") for o in extra):
            assert str(OmegaConf.select(cfg, key)) == value, (override, key)


def test_readme_switch_table_covers_every_model_group():
    groups = {o.split("=")[0] for o in readme_switch_groups()}
    on_disk = {f"model/{p.name}" for p in (README.parent / "conf" / "model").iterdir() if p.is_dir()}
    assert on_disk <= groups, sorted(on_disk - groups)


REPRODUCE = README.parent / "experiments" / "cpu" / "reproduce.sh"


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
    assert f"{total} jobs" in README.read_text() and f"all {total} jobs" in REPRODUCE.read_text(), total
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
