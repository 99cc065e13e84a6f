"""What a run dir says about its data, read through the config it was trained with (`.hydra/config.yaml`, read by
`load_run_config`, the one reader of a saved run config): the run dir of a checkpoint, the probe set, the validation
blocks and the bytes of their text. Read by the sinklab target (`sinklab.targets.native`), the evaluations, the export
and the report."""
from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from sinklab.errors import UserError

RUN_CONFIG = Path(".hydra", "config.yaml")  # a run dir's composed config, as Hydra saved it


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a training run dir: it holds the run's config (RUN_CONFIG)."""
    return (Path(path) / RUN_CONFIG).is_file()


def load_run_config(run_dir: Path):
    """The config a run was trained with (RUN_DIR/.hydra/config.yaml) as a DictConfig that resolves outside Hydra:
    every reader of a saved run config reads it through here.

    Hydra saves the composed config unresolved. A run started without paths.output_dir (the README's default run)
    keeps conf/paths/default.yaml's `${paths.log_dir}/${task_name}/runs/${now:%Y-%m-%d_%H-%M-%S}`, and `now` is a
    resolver only Hydra registers: outside it, resolving paths.output_dir, or any key that interpolates it (the
    checkpoint dir, the loggers' dirs, the whole config), raises UnsupportedInterpolationType. A run's output dir is
    the dir that holds its .hydra/ (sinklab-train sets paths.output_dir to Hydra's run dir), so paths.output_dir is
    set to `run_dir` here, where the run is now: the config resolves for old runs too, and for a run dir moved or
    copied elsewhere. One line naming the file when it is not a readable YAML mapping."""
    from omegaconf import DictConfig, OmegaConf

    path = Path(run_dir) / RUN_CONFIG
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path}: not a readable run config ({type(err).__name__}: {first})") from None
    if not isinstance(cfg, DictConfig):
        raise UserError(f"{path}: not a run config (a YAML mapping of the training config)")
    if isinstance(cfg.get("paths"), DictConfig):
        cfg.paths.output_dir = str(run_dir)
    return cfg


def is_sweep_dir(path: Path) -> bool:
    """Whether `path` is a multirun dir: no run of its own (no .hydra/, no checkpoints/), job dirs below it."""
    p = Path(path)
    return p.is_dir() and not is_run_dir(p) and not (p / "checkpoints").exists() and bool(sweep_jobs(p))


def job_sort_key(name: str) -> tuple:
    """A sweep's job dirs in job-number order (0, 1, ..., 10), named ones after them by name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def sweep_jobs(sweep_dir: Path) -> list[Path]:
    """The job dirs of a multirun dir (0/, 1/, ... or named subdirs holding a run config), by job number."""
    return sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and is_run_dir(p)),
                  key=lambda p: job_sort_key(p.name))


def parse_overrides(lines: Sequence[str]) -> list[tuple[str, Any, str, bool]]:
    """[(key, typed value, value as written, is_sweep)] of override lines (a job's .hydra/overrides.yaml, a
    multirun's command line) with Hydra's own override grammar. Deletions (~key) are dropped. Falls back to splitting
    at '=' for a line Hydra cannot parse."""
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def coerce(text: str) -> Any:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text

    parser = OverridesParser.create()
    out = []
    for line in map(str, lines):
        try:
            o = parser.parse_override(line)
        except Exception:
            key, _, val = line.partition("=")
            out.append((key.lstrip("+~"), coerce(val), val, "," in val))
            continue
        if o.is_delete():
            continue
        if o.is_sweep_override():
            out.append((o.key_or_group, None, line.partition("=")[2], True))
        else:
            out.append((o.key_or_group, o.value(), o.get_value_element_as_str(), False))
    return out


def override_texts(job_dir: Path) -> dict[str, str]:
    """KEY -> the value as written, of a job's .hydra/overrides.yaml (none when it is missing or unreadable)."""
    import yaml

    try:
        lines = yaml.safe_load((Path(job_dir) / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return {}
    return {key: text for key, _, text, _ in parse_overrides(lines if isinstance(lines, list) else [])}


def _choices(job_dir: Path) -> dict:
    """A job's config-group choices (.hydra/hydra.yaml's hydra.runtime.choices: model/gate -> elementwise, ...)."""
    import yaml

    try:
        saved = yaml.safe_load((Path(job_dir) / ".hydra" / "hydra.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return ((saved.get("hydra") or {}).get("runtime") or {}).get("choices") or {}


def matching_job(sweep_dir: Path, cfg, choices: Optional[dict] = None, flag: str = "init_from") -> tuple[Path, dict]:
    """The job of a multirun dir with this run's settings: the keys its jobs were run with different values of (the
    sweep's own), and the seed, equal in both; a config key compares the composed values (`cfg`), a config group
    (model/gate=elementwise) the group choices (`choices`, this run's hydra.runtime.choices). Returns the job dir and
    those settings. A warm start's second stage finds its first stage's model this way (`init_from=SWEEP_DIR`); a
    second stage whose every job starts from one setting of the first stage's (`experiment.first_stage_setting`,
    e.g. {experiment.variant: dense}) asks for that setting instead of its own value of those keys. One line when no
    job or several match."""
    from omegaconf import OmegaConf

    choices = dict(choices or {})

    def value(c, key, group_choices):
        if key in choices:
            return group_choices.get(key)
        v = OmegaConf.select(c, key)
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v

    jobs = sweep_jobs(sweep_dir)
    texts = {job: override_texts(job) for job in jobs}
    swept = [k for k in dict.fromkeys(k for t in texts.values() for k in t)
             if len({t.get(k) for t in texts.values()}) > 1 and k.split(".")[0].split("/")[0] != "hydra"]
    keys = ["seed", *(k for k in swept if k != "seed")]
    fixed = OmegaConf.to_container(OmegaConf.select(cfg, "experiment.first_stage_setting") or OmegaConf.create({}))
    want = {k: fixed[k] if k in fixed else value(cfg, k, choices) for k in keys}
    have = {job: {k: value(load_run_config(job), k, _choices(job)) for k in keys} for job in jobs}
    found = [job for job in jobs if have[job] == want]
    if len(found) == 1:
        return found[0], want
    shown = ", ".join(f"{k}={v}" for k, v in want.items())
    if not found:
        jobs_shown = "; ".join(f"{job.name}: " + ", ".join(f"{k}={v}" for k, v in have[job].items()) for job in jobs)
        raise UserError(f"{flag}={sweep_dir}: no job of that sweep has this run's {shown} (its jobs: {jobs_shown}); "
                        "allowed: a sweep that ran these settings, a run dir or a .ckpt")
    raise UserError(f"{flag}={sweep_dir}: {len(found)} jobs have this run's {shown} "
                    f"({', '.join(j.name for j in found)}); name one: {flag}={found[0]}")


def run_dir_of(ckpt: Path) -> Optional[Path]:
    """The training run dir (holding .hydra/config.yaml) of a checkpoint, if there is one: RUN/checkpoints/last.ckpt
    and RUN/checkpoints/kept/*.ckpt belong to RUN."""
    for d in (ckpt.parent, ckpt.parent.parent, ckpt.parent.parent.parent):
        if is_run_dir(d):
            return d
    return None


def checkpoint_and_run_dir(target: str) -> tuple[Path, Optional[Path]]:
    """TARGET (a .ckpt or a run dir) -> its checkpoint and the training run dir it belongs to (None for a bare
    checkpoint)."""
    from sinklab.runs.checkpoints import find_checkpoint

    path = Path(target)
    if not path.exists():
        raise UserError(f"TARGET {target}: no such checkpoint or run dir")
    ckpt = find_checkpoint(path)
    return ckpt, path if path.is_dir() and is_run_dir(path) else run_dir_of(ckpt)


def read_run_data(run_dir: Path, overrides: dict, read: Callable, flag: str, what: str, hint: str):
    """read(dm) of the run's data module (`build_data_module`: sinklab's own, whatever the file names) with data.*
    `overrides`, prepared. Every failure is
    one UserError starting with `flag` and ending with `hint` (what to pass instead)."""
    from omegaconf import OmegaConf

    cfg = load_run_config(run_dir)
    if "data" not in cfg or cfg.data is None:
        raise UserError(f"{flag}: {run_dir / RUN_CONFIG} has no data section; {hint}")
    try:
        from sinklab.data.config import build_data_module
    except ImportError as err:
        raise UserError(f"{flag}: the data module is not available ({err}); {hint}") from None

    data = cfg.data
    for key, value in overrides.items():
        if value is not None:
            OmegaConf.update(data, key, value, force_add=True)
    try:
        dm = build_data_module(data, f"{flag}: {run_dir / RUN_CONFIG}")
    except UserError as err:
        raise UserError(f"{err}; {hint}") from None
    try:
        dm.prepare()
        return read(dm)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{flag}: cannot read {what} of {run_dir} ({type(err).__name__}: {first}); {hint}") from None


def probe_tokens(run_dir: Path, num_seqs: Optional[int], seq_len: Optional[int]) -> torch.Tensor:
    """The run's probe set through its data config: build_data_module(cfg.data).prepare().probe_tokens().

    --num-seqs / --seq-len set the data module's own probe size (data.probe_num_seqs / data.probe_seq_len), so a
    different size is still the data module's probe set (evenly spaced held-out windows), not a slice of it."""
    tokens = read_run_data(run_dir, {"probe_num_seqs": num_seqs, "probe_seq_len": seq_len},
                           lambda dm: torch.as_tensor(dm.probe_tokens()).long(), "--input natural", "the probe set",
                           "pass --tokens or --input random|repeat")
    if tokens.ndim != 2 or (num_seqs is not None and tokens.shape[0] != num_seqs) or \
            (seq_len is not None and tokens.shape[1] != seq_len):
        raise UserError(f"--input natural: the data module returned a probe set of shape {tuple(tokens.shape)}, "
                        f"asked for ({num_seqs}, {seq_len})")
    return tokens


def token_texts(run_dir: Path, ids: Sequence[int]) -> list[str]:
    """Each token id as text through the run's tokenizer (its data module's, `decode_each`); the ids themselves for
    data without a tokenizer (the synthetic tasks)."""
    from sinklab.data.tokenizer import decode_each

    return read_run_data(run_dir, {"num_workers": 0}, lambda dm: decode_each(getattr(dm, "tokenizer", None), ids),
                         "TARGET", "the tokenizer", "pass a run dir whose data config has the tokenizer")


def val_blocks(dm, n_batches: Optional[int]) -> list[torch.Tensor]:
    """The run's first `n_batches` validation batches (B, T + 1) (all with None), as the training validated on them:
    the data module's (LMDataModule.val_dataloader: the BOS token first when data.bos, as in every training block;
    with data.retrieval its first loader, the second holding the retrieval samples)."""
    loaders = dm.val_dataloader()
    return list(islice(loaders[0] if isinstance(loaders, list) else loaders, n_batches))
