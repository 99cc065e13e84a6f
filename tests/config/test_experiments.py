"""Experiment presets (conf/experiment/) at both scales (conf/scale/).

Fast, in-process: every preset composes at scale=cpu and scale=paper; its claims name settings its sweep runs; its
sweep (hydra.sweeper.params) expands into jobs that each compose (the composition of the preset and the job's config
group choices, then Hydra's value-override stage: tests/helpers/configs.py), pass the training entry's validation
(model, optim, trainer, data controls) and differ from one another; each job finds its row of the paper's table the
way `sinklab report` looks it up, and the sweep covers every row of that table; the scale presets hold the reference
setup and the per-scale tables keep the paper's ratios.

Real training (`slow`; CI's `ci` tier, after the default suite, runs the presets of TRAINED, whose jobs change every
data key and a key of every section any preset's job changes; all presets with -m slow): one job per preset (the first
job of its sweep whose model/data/optim/trainer config differs from the scale's defaults) runs one step as a real
multirun (`-m experiment=NAME`, the sweep restricted through `hydra.sweeper.params`) in a temporary sweep dir, then
`sinklab report` reads it back with the paper's numbers.
To share one Python start-up (torch + Lightning imports, ~8 s) the presets run one after the other in ONE
subprocess, each through `sinklab.train.entry.main` with the argv `sinklab-train` would get.

Slow (-m slow): every job of every preset, one `sinklab-train -m experiment=NAME` subprocess per preset.
"""
from __future__ import annotations

import csv
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sinklab.config import CONF_DIR, validate_config
from sinklab.data.controls import BlockControls
from sinklab.config.claims import parse_claims
from sinklab.errors import UserError
from sinklab.evals import EVALUATIONS
from sinklab.report import build_report, load_paper_tables, match_paper_row
from sinklab.report.paper import values_match
from tests.helpers import REPO, configs, run_cli
from tests.helpers.configs import composed, sweep_jobs

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
SCALES = ("cpu", "paper")
TABLES = load_paper_tables()
# the tables of paper_tables.yaml that no preset trains: the paper's 1B-parameter runs (beyond scale=paper's 60M
# model) and the published models' numbers, which `sinklab measure --hf-model`'s model table reads
# (sinklab/analysis/model_table.py). Every other table is a preset's (test_one_preset_per_ablation_of_the_paper).
NOT_TRAINED = {"scale_1b", "pretrained_models", "pretrained_base_vs_chat"}
EXPERIMENTS_README = REPO / "experiments" / "README.md"
CONTEXT = {"cpu": 64, "paper": 2048}
SECTIONS = ("model", "data", "optim", "trainer")
# keeps one job to seconds: one step, validation and sink measurement on a few blocks
FAST = ["++trainer.max_steps=1", "optim.warmup_steps=0", "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1", "callbacks.sink.every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=1",
        "data.batch_size=2", "data.probe_num_seqs=8", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "peak_flops=null"]  # no 0.3 s FLOP/s measurement per job
ENV = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # one thread: a tiny model gains nothing from more


# ------------------------------------------------------------------------------------------------------ helpers
def sweep_params(name: str, scale: str) -> dict[str, str]:
    cfg = composed(f"experiment={name}", f"scale={scale}", hydra=True)
    return OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=False) or {}


def preset_jobs(name: str, scale: str) -> list[list[str]]:
    """The override list of every job of the preset's sweep, in job order."""
    return sweep_jobs([f"{k}={v}" for k, v in sweep_params(name, scale).items()])


@functools.lru_cache(maxsize=None)
def _job_config(name: str, scale: str, job: tuple[str, ...]):
    return configs.job_config((f"experiment={name}", f"scale={scale}"), job)


def job_config(name: str, scale: str, job: list[str]):
    """The job's config (cached: tests only read it)."""
    return _job_config(name, scale, tuple(job))


_ABSENT = object()


def value_of(cfg, key: str):
    """A paper_match target as `sinklab report` reads it: the composed config's value, interpolations resolved."""
    v = OmegaConf.select(cfg, key, default=_ABSENT)
    assert v is not _ABSENT, f"paper_match target {key!r} is not a key of the composed config"
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def paper_row(cfg):
    """(table name, index of the matched row or None, the row or None) for one job's config."""
    table_name = cfg.experiment.paper_table
    table = TABLES.get(table_name) if table_name else None
    match = OmegaConf.to_container(cfg.experiment.paper_match)
    if isinstance(table, list):
        row = match_paper_row(table, match, lambda k: value_of(cfg, k))
        return table_name, (None if row is None else table.index(row)), row
    return table_name, None, table if isinstance(table, dict) and "figure_only" not in table else None


def sections(cfg) -> dict:
    """What a job trains: model, data, optim and trainer settings (without the trainer's time-stamped run dir)."""
    out = {s: OmegaConf.to_container(cfg[s], resolve=True) for s in SECTIONS}
    out["trainer"].pop("default_root_dir", None)
    return out


def fast_job(name: str) -> list[str]:
    """The first job of the preset's CPU sweep whose model/data/optim/trainer differ from scale=cpu's defaults."""
    default = sections(composed("scale=cpu"))
    jobs = preset_jobs(name, "cpu")
    return next((j for j in jobs if sections(job_config(name, "cpu", j)) != default), jobs[0])


def first_stage(name: str) -> Optional[str]:
    """The preset whose models a second-stage preset starts from (experiment.first_stage), else None."""
    return OmegaConf.select(composed(f"experiment={name}"), "experiment.first_stage")


@functools.lru_cache(maxsize=None)
def imported(name: str) -> bool:
    """Whether the preset starts from an imported model (experiment.starts_from; its one-step jobs train in the
    `real` tier, on the model it names: tests/real/). Read from the preset's file and the presets its defaults list
    includes, its own value first, not composed: the parametrisations below ask at collection, in every xdist worker,
    where composing each preset took ~15 s; test_preset_sweep_composes_... checks it against the composed config."""
    preset = yaml.safe_load((CONF_DIR / "experiment" / f"{name}.yaml").read_text()) or {}
    if "starts_from" in (preset.get("experiment") or {}):
        return preset["experiment"]["starts_from"] is not None
    included = [d.removeprefix("/experiment/") for d in preset.get("defaults") or []
                if isinstance(d, str) and d != "_self_" and (not d.startswith("/") or d.startswith("/experiment/"))]
    return any(imported(d) for d in included)


def first_stage_setting(name: str) -> list[str]:
    """The overrides of the first stage's setting every job of a second-stage preset starts from
    (experiment.first_stage_setting: {experiment.variant: dense} -> [experiment.variant=dense]), [] if none."""
    setting = OmegaConf.select(composed(f"experiment={name}"), "experiment.first_stage_setting")
    return [f"{k}={v}" for k, v in OmegaConf.to_container(setting).items()] if setting else []


def restrict(job: list[str]) -> str:
    """hydra.sweeper.params override that keeps only this job's values (the dict merges into the preset's params)."""
    items = []
    for o in job:
        key, _, value = o.partition("=")
        assert "'" not in value, value
        items.append(f"{key}:'{value}'")
    return "hydra.sweeper.params={" + ",".join(items) + "}"


def metric_steps(path: Path, column: str) -> list[int]:
    with open(path, newline="") as f:
        return [int(float(r["step"])) for r in csv.DictReader(f) if r.get(column) not in (None, "")]


def check_job_dir(job_dir: Path, name: str) -> dict:
    """status.json completed (failed only where the paper's training failed too), metrics.csv with a step's loss and
    sink rate, and the job's own config saved by Hydra. Returns the status."""
    status = json.loads((job_dir / "status.json").read_text())
    cfg = OmegaConf.load(job_dir / ".hydra" / "config.yaml")
    assert cfg.experiment.name == name
    _, _, row = paper_row(cfg)
    allowed = ("completed", "failed") if row and row.get("failed") else ("completed",)
    assert status["status"] in allowed, f"{job_dir}: {status}"
    if status["status"] == "completed":
        metrics = job_dir / "metrics.csv"
        assert metrics.is_file()
        assert metric_steps(metrics, "train/loss") and metric_steps(metrics, "sink/sink1")
        assert math.isfinite(status["final"]["train/loss"])
    return status


# ------------------------------------------------------------------------------------------- composition (fast)
@pytest.mark.slow
@pytest.mark.ci
def test_a_job_that_sets_values_composes_as_hydra_composes_it():
    """The tests compose a job as the composition of the preset and the job's config group choices plus Hydra's
    value-override stage (tests/helpers/configs.py): for one job of each kind of value the presets sweep, alone or
    with a config group choice, and one job that only chooses a config group, at both scales, the config equals
    Hydra's full composition (values, interpolations unresolved, struct flag)."""
    kinds = {}
    for name in PRESETS:
        for job in preset_jobs(name, "cpu"):
            split = configs.split_overrides((f"experiment={name}", "scale=cpu"), job)
            if split is not None:
                kinds.setdefault(tuple(sorted(o.partition("=")[0] for o in job)), (name, job, bool(split[1])))
    assert {("experiment.variant",), ("model.prefix_len",), ("data.random_positions",),  # values only
            ("experiment.variant", "model/head_norm"), ("experiment.variant", "optim"),  # and config groups
            ("model.gated_norm", "model/gate", "model/norm"), ("model/ffn",)} <= set(kinds), kinds
    checked = [kind for kind, (_, _, sets_values) in kinds.items() if sets_values] + [("model/ffn",)]
    for name, job, _ in map(kinds.get, checked):
        for scale in SCALES:
            base = (f"experiment={name}", f"scale={scale}")
            fast, full = configs.job_config(base, job), configs.job_config(base, job, full=True)
            assert OmegaConf.to_container(fast) == OmegaConf.to_container(full), (name, scale, job)
            assert sections(fast) == sections(full) and OmegaConf.is_struct(fast) == OmegaConf.is_struct(full)
    assert configs.value_overrides(("experiment=ffn",), ["model/ffn=relu"]) is None
    assert configs.value_overrides(("experiment=muon",), ["optim=adamw", "experiment.variant=lr_x0.5"]) is None
    assert configs.split_overrides(("experiment=muon",), ["optim=adamw", "experiment.variant=lr_x0.5"])[0] == \
        ["optim=adamw"]
    assert configs.split_overrides(("experiment=ffn",), ["+model.extra=1"]) is None  # composed in full


@pytest.mark.parametrize("scale", ("quick", *SCALES))
def test_each_scale_saves_its_last_step(scale):
    """The checkpoint cadence divides max_steps, so checkpoints/last.ckpt (what `sinklab measure / quant / eval`
    read) is the model at the end of training, not one up to every_n_train_steps - 1 steps older."""
    cfg = composed(f"scale={scale}")
    assert cfg.trainer.max_steps % cfg.callbacks.checkpoint.every_n_train_steps == 0, scale


def tables_named(node) -> set[str]:
    """The paper tables a preset file names (under `paper_table`, or as the values of a `paper_tables` mapping that
    an interpolation picks from), anywhere in it."""
    if isinstance(node, dict):
        named = set()
        for key, value in node.items():
            if key == "paper_table" and isinstance(value, str) and "${" not in value:
                named.add(value)
            elif key == "paper_tables" and isinstance(value, dict):
                named |= set(value.values())
            else:
                named |= tables_named(value)
        return named
    return set().union(*map(tables_named, node)) if isinstance(node, list) else set()


def test_one_preset_per_ablation_of_the_paper():
    """Every table of the paper (paper_tables.yaml) that its setup trains is named by a preset, one preset per
    ablation: only the reference setup's numbers (`default`) serve several (sink_free, post_norm). The presets beyond
    the paper name their source instead (experiment.reference), and each preset's jobs match the rows of its tables
    (both checked with each preset's sweep)."""
    assert NOT_TRAINED <= set(TABLES), sorted(NOT_TRAINED - set(TABLES))
    presets_of: dict[str, set[str]] = {}
    for name in PRESETS:
        for table in tables_named(yaml.safe_load((CONF_DIR / "experiment" / f"{name}.yaml").read_text())):
            presets_of.setdefault(table, set()).add(name)
    assert set(presets_of) == set(TABLES) - NOT_TRAINED, \
        f"tables no preset trains: {sorted(set(TABLES) - NOT_TRAINED - set(presets_of))}; " \
        f"tables not in paper_tables.yaml: {sorted(set(presets_of) - set(TABLES))}"
    assert all(len(names) == 1 for table, names in presets_of.items() if table != "default"), presets_of


def test_every_preset_is_documented():
    """experiments/README.md has one section per preset (`### NAME` under "## Presets"), and none of a preset that is
    gone: the list of presets is the documented one."""
    section = EXPERIMENTS_README.read_text().split("\n## Presets\n", 1)[1].split("\n## ", 1)[0]
    documented = sorted(re.findall(r"^### (\w+)", section, re.MULTILINE))
    assert documented == PRESETS, f"documented, no preset: {sorted(set(documented) - set(PRESETS))}; " \
                                  f"a preset, not documented: {sorted(set(PRESETS) - set(documented))}"


@pytest.mark.parametrize("scale", ["cpu", pytest.param("paper", marks=[pytest.mark.slow, pytest.mark.ci])])  # CI: both
@pytest.mark.parametrize("name", PRESETS)
def test_preset_sweep_composes_validates_and_covers_the_paper_table(name, scale):
    base = composed(f"experiment={name}", f"scale={scale}", hydra=True)
    assert base.experiment.name == name
    assert base.hydra.runtime.choices.scale == scale and base.scale.name == scale  # scale= beats the preset's own
    setting = OmegaConf.select(base, "experiment.setting")  # a preset whose variants set the context (no_bos)
    context = setting.get("ctx") if OmegaConf.is_dict(setting) else None
    assert imported(name) == (OmegaConf.select(base, "experiment.starts_from") is not None)  # read off the files
    if imported(name):  # the model is the import's (its RoPE range); the training context is the data's own
        assert base.model.block_size >= base.data.block_size
    else:
        assert base.model.block_size == (context or CONTEXT[scale]) and base.data.block_size == base.model.block_size
    assert base.ckpt_path == "auto" and name in base.tags and f"scale-{scale}" in base.tags
    assert base.hydra.sweeper._target_.endswith("BasicSweeper")
    params = sweep_params(name, scale)
    assert params and all("${" not in str(v) for v in params.values())  # literal values: the report reads them
    jobs = preset_jobs(name, scale)
    assert len(jobs) >= 2

    seen_configs, matched, tables_used = [], {}, set()
    for job in jobs:
        cfg = job_config(name, scale, job)
        if OmegaConf.select(cfg, "experiment.first_stage") or imported(name):  # it starts from other models
            with pytest.raises(UserError, match="^init_from is missing: experiment="):
                validate_config(cfg)
            cfg = OmegaConf.merge(cfg, {"init_from": "logs/train/multiruns/first_stage"})
        validate_config(cfg)  # what sinklab-train checks before any data is loaded
        d = cfg.data
        BlockControls.from_config(OmegaConf.to_object(d))  # DataConfig: its rules hold (controls vs block_size)
        assert d.max_unique_tokens is None or d.max_unique_tokens > d.block_size
        window = cfg.model.window
        assert window is None or 1 <= window <= cfg.model.block_size
        for key in OmegaConf.to_container(cfg.experiment.paper_match).values():
            value_of(cfg, key)
        config = sections(cfg)
        assert config not in seen_configs, f"{job} trains the same model as an earlier job"
        seen_configs.append(config)

        table_name, index, row = paper_row(cfg)
        if table_name is None:  # a claim of another paper: the preset names it
            assert cfg.experiment.reference, f"{job}: experiment.paper_table is null and experiment.reference unset"
            continue
        assert table_name in TABLES, f"{job}: experiment.paper_table={table_name!r} is not in paper_tables.yaml"
        tables_used.add(table_name)
        table = TABLES[table_name]
        if isinstance(table, list):
            match = OmegaConf.to_container(cfg.experiment.paper_match)
            assert index is not None, f"{job}: no row of paper table {table_name!r} matches {match}"
            assert (table_name, index) not in matched, f"{job} and {matched[table_name, index]} match the same row"
            matched[table_name, index] = job
        elif "figure_only" in table:
            assert not cfg.experiment.paper_match, "a figure-only entry has no fields to match"
    assert tables_used or base.experiment.reference, "no job has a paper table and the preset names no reference"
    for table_name in tables_used:  # the sweep covers the whole table
        table = TABLES[table_name]
        if isinstance(table, list):
            missing = [r for i, r in enumerate(table) if (table_name, i) not in matched]
            assert not missing, f"paper rows no job of the sweep matches: {missing}"


# the presets of other papers' claims state them (issue 28)
WITH_CLAIMS = {"gate_positions", "outliers_quant", "residual_sinks", "sink_uses", "value_gates", "diff_attention",
               "muon", "qk_norm", "layer_patterns", "sparse_attention", "head_positions", "head_geometry", "retrieval",
               "retrieval_128", "retrieval_warm", "dsa_retrofit", "retrofit", "hybrids"}


@pytest.mark.parametrize("name", PRESETS)
def test_claims_name_settings_of_the_preset_sweep(name):
    """A preset's claims (sinklab.config.claims) are well formed and name only settings its sweep runs, at both
    scales."""
    parser = OverridesParser.create()
    for scale in SCALES:
        cfg = composed(f"experiment={name}", f"scale={scale}", hydra=True)
        exp = OmegaConf.to_container(OmegaConf.masked_copy(cfg.experiment, [k for k in ("baseline", "claims")
                                                                             if k in cfg.experiment]))
        values = {k: list(parser.parse_override(f"{k}={v}").sweep_iterator())
                  for k, v in sweep_params(name, scale).items()}
        baseline, claims = parse_claims(exp, EVALUATIONS)
        assert bool(claims) == (name in WITH_CLAIMS)
        for claim in claims:
            assert claim.text, claim.id
            for setting in (claim.treated, claim.partner):
                for key, value in setting.items():
                    assert key in values, f"{name}: claim {claim.id} names {key}, which the preset does not sweep"
                    assert any(values_match(value, v) for v in values[key]), \
                        f"{name}: claim {claim.id}: {key}={value} is not one of the sweep's values {values[key]}"


def test_paper_scale_is_the_reference_setup():
    cfg = composed("scale=paper", hydra=True)
    m, d, t, o = cfg.model, cfg.data, cfg.trainer, cfg.optim
    assert (m.n_layer, m.n_head, m.d_model, m.d_ff, m.block_size) == (10, 8, 768, 1536, 2048)
    assert cfg.hydra.runtime.choices.data == "pile" and d.tokenizer == "EleutherAI/gpt-neox-20b"
    assert d.pad_vocab_to_multiple_of == 256  # GPT-NeoX's 50277 ids -> 50432
    sequences = d.batch_size * t.devices * t.num_nodes * t.accumulate_grad_batches
    assert sequences == 512 and sequences * d.block_size == 1_048_576
    assert (t.max_steps, o.lr, o.weight_decay, o.warmup_steps, o.schedule) == (20000, 4e-4, 0.1, 100, "constant")
    assert tuple(o.betas) == (0.9, 0.95) and t.gradient_clip_val == 1.0
    assert t.precision == "bf16-mixed" and t.strategy == "ddp" and t.accelerator == "gpu"
    assert cfg.callbacks.sink.every_n_steps == 1000 and cfg.callbacks.checkpoint.every_n_train_steps == 1000
    assert (t.max_steps * t.accumulate_grad_batches) % t.val_check_interval == 0  # validated at the last step
    validate_config(cfg)


def test_cpu_scale_is_the_laptop_recipe():
    cfg = composed("scale=cpu", hydra=True)
    assert cfg.hydra.runtime.choices.model == "tiny" and cfg.model.block_size == 64
    assert cfg.hydra.runtime.choices.data == "shakespeare" and cfg.trainer.accelerator == "cpu"
    assert cfg.trainer.devices * cfg.trainer.accumulate_grad_batches * cfg.data.batch_size == 32
    # the sink recipe of experiments/cpu/RESULTS.md
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.optim.weight_decay) == (3000, 6e-3, 1.0)
    assert (cfg.model.n_head, cfg.data.vocab_size, cfg.data.bos, cfg.data.probe_bos) == (8, 1024, True, True)
    validate_config(cfg)
    # the presets that put their own token at position 1 turn BOS off, in training blocks and in the probe
    for name in ("fixed_token_position", "random_tokens"):
        data = composed(f"experiment={name}").data
        assert not data.bos and not data.probe_bos, name


def _variant(name: str, scale: str, variant: str):
    cfg = job_config(name, scale, [f"experiment.variant={variant}"])
    assert cfg.experiment.variant == variant
    return cfg


def _global_batch(cfg) -> int:
    return cfg.data.batch_size * cfg.trainer.devices * cfg.trainer.num_nodes * cfg.trainer.accumulate_grad_batches


@pytest.mark.parametrize("name", ["learning_rate", "batch_size", "sigmoid_no_norm_lr_wd", "window", "data_amount"])
def test_per_scale_tables_keep_the_papers_ratios(name):
    """The presets that list values per scale map the paper's values to the CPU scale by the same ratios to the
    scale's defaults, and their paper-default variant reproduces each scale's defaults (fails when scale/cpu.yaml
    changes its lr, steps or batch without the presets' cpu columns)."""
    base = {s: composed(f"scale={s}") for s in SCALES}
    variants = [job[0].partition("=")[2] for job in preset_jobs(name, "cpu")]
    assert variants == [job[0].partition("=")[2] for job in preset_jobs(name, "paper")]
    for v in variants:
        cfg = {s: _variant(name, s, v) for s in SCALES}

        def same_ratio(f):
            """f(variant) / f(scale defaults) is the same at both scales."""
            r = {s: f(cfg[s]) / f(base[s]) for s in SCALES}
            assert math.isclose(r["cpu"], r["paper"]), f"{name} {v}: ratios to the scale defaults differ: {r}"

        if name in ("learning_rate", "sigmoid_no_norm_lr_wd"):
            same_ratio(lambda c: c.optim.lr)
            same_ratio(lambda c: c.trainer.max_steps)
            if name == "sigmoid_no_norm_lr_wd":  # the paper's weight decays, unscaled
                assert cfg["cpu"].optim.weight_decay == cfg["paper"].optim.weight_decay
            else:  # the scale's own weight decay
                assert all(cfg[s].optim.weight_decay == base[s].optim.weight_decay for s in SCALES)
        elif name == "batch_size":
            same_ratio(_global_batch)
            assert cfg["cpu"].trainer.max_steps == base["cpu"].trainer.max_steps
        elif name == "window":
            same_ratio(lambda c: c.model.window / c.model.block_size if c.model.window else 1.0)
        elif name == "data_amount":  # unique tokens per token trained on
            seen = {s: base[s].trainer.max_steps * _global_batch(base[s]) * base[s].data.block_size for s in SCALES}
            if cfg["paper"].data.max_unique_tokens is None:  # the whole ~5B-token split
                assert v == "5B"
                continue
            fraction = {s: cfg[s].data.max_unique_tokens / seen[s] for s in SCALES}
            assert math.isclose(fraction["cpu"], fraction["paper"], rel_tol=0.05), fraction
    default = {"learning_rate": "lr4e-4_20k", "batch_size": "1M", "sigmoid_no_norm_lr_wd": "lr4e-4_wd0.1"}.get(name)
    if default:
        for s in SCALES:
            cfg = _variant(name, s, default)
            assert cfg.optim.lr == base[s].optim.lr
            if name != "sigmoid_no_norm_lr_wd":  # it sets the paper's weight decays, unscaled (cpu's base is 1.0)
                assert cfg.optim.weight_decay == base[s].optim.weight_decay
            assert cfg.trainer.max_steps == base[s].trainer.max_steps and _global_batch(cfg) == _global_batch(base[s])


def test_paired_values_move_together_and_unknown_variants_fail():
    cfg = composed("experiment=learning_rate", "scale=paper", "experiment.variant=lr2e-4_40k")
    assert (cfg.optim.lr, cfg.trainer.max_steps) == (2e-4, 40000)
    cfg = composed("experiment=learning_rate", "scale=cpu", "experiment.variant=lr2e-4_40k")
    assert (cfg.optim.lr, cfg.trainer.max_steps) == (3e-3, 6000)
    cfg = composed("experiment=fixed_value_bias", "experiment.variant=20v2")
    m = cfg.model
    assert (m.attn_bias, m.attn_bias_fixed_value_scale, m.attn_bias_fixed_value_seed) == ("k", 20.0, 1)
    unknown = composed("experiment=learning_rate", "experiment.variant=lr3e-4_20k")
    with pytest.raises(OmegaConfBaseException):  # a label the table lacks
        OmegaConf.to_container(unknown.optim, resolve=True)
    # what sinklab-train says before any compute: one line with the allowed labels, or the scales the preset has
    with pytest.raises(UserError, match=r"^experiment.variant='lr3e-4_20k' is not a variant of "
                                        r"experiment=learning_rate; allowed: lr8e-4_10k, .*lr1e-4_80k$"):
        validate_config(unknown)
    with pytest.raises(UserError, match=r"^experiment=learning_rate has no settings for scale=quick; "
                                        r"allowed: scale=paper, scale=cpu$"):
        validate_config(composed("experiment=learning_rate", "scale=quick"))
    with pytest.raises(UserError, match=r"^experiment=no_bos has no settings for no scale \(~scale\); "
                                        r"allowed: scale=cpu, scale=quick, scale=paper$"):
        validate_config(composed("experiment=no_bos", "~scale"))


def test_no_bos_variants_move_one_axis_at_fixed_tokens_per_step():
    """experiment=no_bos: no BOS in training blocks or probes; at each scale every variant sees the same tokens per
    optimizer step as the scale's own default, and differs from the centre variant (ctx_mid at the CPU scales, the
    context-2048 60m model at scale=paper) in one axis: context, depth / width, lr or weight decay."""
    axes = {"ctx": ("model.block_size",), "deep": ("model.n_layer",), "wide": ("model.d_model", "model.d_ff"),
            "lr": ("optim.lr",), "wd": ("optim.weight_decay",)}
    keys = sorted({k for ks in axes.values() for k in ks})
    for scale in ("quick", *SCALES):
        base = composed(f"scale={scale}")
        tokens = _global_batch(base) * base.data.block_size
        centre = _variant("no_bos", scale, "ctx_long" if scale == "paper" else "ctx_mid")
        variants = [job[0].partition("=")[2] for job in preset_jobs("no_bos", scale)]
        assert len(variants) == 10
        for v in variants:
            cfg = _variant("no_bos", scale, v)
            assert not cfg.data.bos and not cfg.data.probe_bos, (scale, v)
            assert _global_batch(cfg) * cfg.model.block_size == tokens, (scale, v)
            changed = {k for k in keys if value_of(cfg, k) != value_of(centre, k)}
            allowed = set().union(*(axes[a] for a in v.split("_") if a in axes))  # deep_wide: both
            assert changed <= allowed, (scale, v, changed)
            assert changed or v == centre.experiment.variant, (scale, v)
        big = _variant("no_bos", scale, "deep_wide")
        assert big.model.n_layer >= 2 * centre.model.n_layer and big.model.d_model >= 2 * centre.model.d_model


# ------------------------------------------------------------------------------ one real step per preset (fast)
DRIVER = """
import json, os, sys
from hydra.core.global_hydra import GlobalHydra
from sinklab.train import entry
for argv in json.loads(sys.argv[1]):
    GlobalHydra.instance().clear()
    os.environ.pop("HYDRA_FULL_ERROR", None)
    sys.argv = ["sinklab-train", *argv]
    print("=== sinklab-train " + " ".join(argv), flush=True)
    try:
        entry.main()
    except SystemExit as e:
        print(f"=== exit {e.code}", flush=True)
"""


# CI's `ci` tier trains one step of these presets (each ~2.5 s, most of it Hydra's multirun around the step):
# together their one-step jobs change every data key that any preset's one-step job changes (the data module's
# controls shape the batches the step reads) and a key of each section (model, data, optim, trainer) that one changes
# (test_the_trained_presets_cover_every_changed_key). The model's keys select components and sizes that train a step
# in tests/model (test_contracts.py: every component and knob value; test_model_zoo.py: every model/ switch file and
# size); the optim and trainer keys are numbers the same training step reads. The other presets train with the other
# slow tests (this test, and every job of every preset below).
# the presets whose models start here (the others start from an imported model: the real tier trains them)
LOCAL_PRESETS = [n for n in PRESETS if not imported(n)]
TRAINED = ("batch_size", "data_amount", "fixed_token_position", "gate_positions", "learning_rate", "random_tokens",
           "retrieval", "retrieval_128")


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def changed_keys(name: str) -> set[str]:
    """The config keys (model/data/optim/trainer leaves) whose value the preset's one-step job changes."""
    default, job = _leaves(sections(composed("scale=cpu"))), _leaves(sections(job_config(name, "cpu", fast_job(name))))
    return {k for k in set(default) | set(job) if default.get(k, _ABSENT) != job.get(k, _ABSENT)}


def test_the_trained_presets_cover_every_changed_key():
    assert set(TRAINED) <= set(PRESETS)
    covered = set().union(*(changed_keys(n) for n in TRAINED))
    sections_covered = {key.split(".", 1)[0] for key in covered}
    for name in (n for n in PRESETS if not imported(n)):  # those train in the real tier (tests/real/)
        changed = changed_keys(name)
        missing = sorted(k for k in changed - covered if k.startswith("data.") or k.split(".", 1)[0]
                         not in sections_covered)
        assert not missing, f"{name}'s one-step job changes {missing}, which no preset of TRAINED does: add {name}"


@pytest.fixture(scope="session")
def fast_sweeps(request, tmp_path_factory):
    """One single-job multirun per preset this session selected (TRAINED with -m ci; all with -m slow); {name: (sweep
    dir, the job's overrides)}."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_preset_trains_one_step_and_reports_the_papers_numbers"}
    selected |= {first_stage(n) for n in selected if first_stage(n) and not first_stage_setting(n)}
    root = tmp_path_factory.mktemp("sweeps")
    runs, out = [], {}
    for name in sorted(selected, key=lambda n: (first_stage(n) is not None, n)):  # first stages first
        job = fast_job(name)
        sweep_dir = root / name
        warm = []
        if first_stage_setting(name):  # the first stage's job of that setting, in a sweep of its own
            first = root / f"{name}_first"
            runs.append(["-m", f"experiment={first_stage(name)}", restrict(first_stage_setting(name)),
                         f"hydra.sweep.dir={first}", *FAST])
            warm = [f"init_from={first}"]
        elif first_stage(name):
            warm = [f"init_from={out[first_stage(name)][0]}"]
        runs.append(["-m", f"experiment={name}", restrict(job), f"hydra.sweep.dir={sweep_dir}", *FAST, *warm])
        out[name] = (sweep_dir, job)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], capture_output=True, text=True,
                          timeout=900, env=ENV, cwd=root)
    (root / "driver.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=(pytest.mark.slow, pytest.mark.ci) if n in TRAINED
                                                 else pytest.mark.slow) for n in LOCAL_PRESETS])
def test_preset_trains_one_step_and_reports_the_papers_numbers(name, fast_sweeps):
    sweep_dir, job = fast_sweeps[name]
    assert (sweep_dir / "multirun.yaml").is_file(), f"no multirun for {name}; see {sweep_dir.parent}/driver.log"
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0"]
    job_dir = sweep_dir / "0"
    overrides = list(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
    assert all(o in overrides for o in job), (job, overrides)  # the restricted sweep ran the chosen job
    status = check_job_dir(job_dir, name)
    assert status["step"] == 1

    report = build_report(sweep_dir)
    assert report["md"].is_file() and len(report["rows"]) == 1
    row = report["rows"][0]
    assert row["status"] == status["status"]
    cfg = OmegaConf.load(job_dir / ".hydra" / "config.yaml")
    _, _, paper = paper_row(cfg)
    if paper is not None:  # the report found the paper's row from the job's own saved config
        numbers = [k for k in row if k.startswith("paper_") and k != "paper_note" and row[k] is not None]
        assert numbers or paper.get("failed"), row
    sweep_cfg = OmegaConf.load(sweep_dir / "multirun.yaml")
    if sweep_cfg.experiment.paper_table is None:  # report.md names the source the preset follows instead
        assert f"- Reference: {sweep_cfg.experiment.reference}" in report["md"].read_text()


@pytest.mark.slow  # trains a 2-job sweep and quantizes it (~35 s): keeps the unit suite under 10 minutes
def test_quant_sweep_gathers_sinklab_quant_of_every_job_into_one_csv(tmp_path, capsys):
    """`sinklab quant --sweep` on a 2-job outliers_quant sweep (one step each) plus a job dir without a checkpoint:
    one quant.json per trained job, the unfinished one skipped, and quant.csv with one row per trained job, keyed
    like report.csv, holding each job's swept variant and its quant.json's numbers, which `sinklab report` reads."""
    bin_dir = str(Path(sys.executable).parent)  # sinklab-train, sinklab and this python
    env = {**ENV, "PATH": bin_dir + os.pathsep + ENV.get("PATH", "")}
    sweep = tmp_path / "sweep"
    variants = ["softmax", "gate_elementwise"]
    train = subprocess.run(["sinklab-train", "-m", "experiment=outliers_quant",
                            restrict(["experiment.variant=" + ",".join(variants)]), f"hydra.sweep.dir={sweep}", *FAST],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that never saved a checkpoint
    rc, out, err = run_cli("sinklab", "quant", "--sweep", str(sweep), "--schemes", "w8a8", "w4a4", "--val-batches",
                               "1", "--calib-batches", "1")
    assert rc == 0, err[-3000:]
    assert f"{sweep / '2'}: no checkpoints/last.ckpt" in err
    assert not (sweep / "2" / "quant.json").exists()

    import pandas as pd

    table = pd.read_csv(sweep / "quant.csv", dtype={"job": str})
    assert list(table["job"]) == ["0", "1"] and list(table["experiment.variant"]) == variants
    report = {r["job"]: r for r in build_report(sweep, metrics=["quant/w4a4_gap"])["rows"]}
    assert list(table["job"]) == [job for job, r in report.items() if r["status"] == "completed"]
    for row in table.to_dict("records"):
        assert report[row["job"]]["quant/w4a4_gap"] == pytest.approx(row["w4a4_gap"], rel=1e-9)
        res = json.loads((sweep / row["job"] / "quant.json").read_text())
        assert set(res["schemes"]) == {"fp32", "w8a8", "w4a4"} and res["val_batches"] == res["calib_batches"] == 1
        for scheme, r in res["schemes"].items():
            for key in ("loss", "ppl", "gap", "rel_gap"):
                assert row[f"{scheme}_{key}"] == pytest.approx(r[key], rel=1e-9), (scheme, key)
            assert row[f"{scheme}_gap"] == pytest.approx(row[f"{scheme}_ppl"] - row["fp32_ppl"], abs=1e-9)
        assert row["fp32_ppl"] == pytest.approx(math.exp(row["fp32_loss"]), rel=1e-6)
        assert row["val_targets"] == res["val_targets"] > 0 and row["weights"] == "per-tensor"


# --------------------------------------------------------------------------------- every job of every preset (slow)
@pytest.mark.slow
@pytest.mark.parametrize("name", LOCAL_PRESETS)
def test_every_job_of_the_preset_trains_one_step(name, tmp_path):
    exe = Path(sys.executable).with_name("sinklab-train")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sinklab.train.entry"]
    warm = []
    if first_stage(name):  # a second stage: its first stage's whole sweep first, each job starts from its match
        first = tmp_path.parent / f"{tmp_path.name}_first"
        only = [restrict(first_stage_setting(name))] if first_stage_setting(name) else []  # that setting's jobs
        proc = subprocess.run([*cmd, "-m", f"experiment={first_stage(name)}", *only, f"hydra.sweep.dir={first}",
                               *FAST], capture_output=True, text=True, timeout=1800, env=ENV, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        warm = [f"init_from={first}"]
    proc = subprocess.run([*cmd, "-m", f"experiment={name}", f"hydra.sweep.dir={tmp_path}", *FAST, *warm],
                          capture_output=True, text=True, timeout=1800, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = preset_jobs(name, "cpu")
    dirs = sorted((p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    assert [p.name for p in dirs] == [str(i) for i in range(len(jobs))]
    for job, job_dir in zip(jobs, dirs):
        assert all(o in list(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")) for o in job)
        check_job_dir(job_dir, name)
    report = build_report(tmp_path)
    assert len(report["rows"]) == len(jobs) and all(r["status"] != "pending" for r in report["rows"])
