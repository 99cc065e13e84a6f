"""Validation before any compute is spent.

`validate_config` checks every user-facing key: each bad value is refused with one line naming the key, the value
and what is allowed, before any data is loaded. Nodes typed by a schema (a dataclass in the ConfigStore: the model,
the optimizer, the data, the trainer, sinklab's callbacks) are checked by their own rules; `SCHEMA` below holds the
keys that have no schema yet.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Iterator, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from sinklab.errors import UserError
from sinklab.model.config import ModelConfig

from .claims import ColumnOwners, parse_claims
from .messages import unknown_key_message
from .schema import Check, choice, either, integer, is_int, not_allowed, number, show, string
from .store import CONF_DIR

__all__ = ["validate_config", "built", "check_devices"]
_MISSING = object()

# key -> (check, required). A key whose parent node is absent or null (callbacks.sink=null) is not checked.
SCHEMA: dict[str, tuple[Check, bool]] = {
    "seed": (integer(0), True),
    "ckpt_path": (string(optional=True), False),
    "init_from": (string(optional=True), False),
    "peak_flops": (either(choice("auto"), number(gt=0, optional=True)), False),
    "compile_backend": (string(), False),
    # loggers
    "logger.wandb.project": (string(), False),
    "logger.wandb.entity": (string(optional=True), False),
    "logger.wandb.name": (string(optional=True), False),
    "logger.wandb.group": (string(optional=True), False),
}
# the top level of conf/train.yaml: its keys and config groups (`+foo=1` would otherwise pass unread); hydra is Hydra's
ROOT_KEYS = ("callbacks", "ckpt_path", "compile_backend", "data", "experiment", "hydra", "init_from", "local", "logger",
             "model", "optim", "paths", "peak_flops", "scale", "seed", "tags", "task_name", "trainer")


def _select(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=True)
    except Exception as err:  # an interpolation that does not resolve, or a ??? value
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"{key} has no value ({first}); set it, e.g. {key}=...") from None


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _check_value(cfg: DictConfig, key: str, check: Check, required: bool) -> None:
    parent = key.rpartition(".")[0]
    if parent and _select(cfg, parent) in (None, _MISSING):
        return
    value = _select(cfg, key)
    if value is _MISSING:
        if required:
            raise UserError(f"{key} is missing; it is required ({check(object()) or 'a value'})")
        return
    value = _plain(value)
    want = check(value)
    if want is not None:
        raise UserError(not_allowed(key, value, want))


def _check_keys(node: Any, prefix: str, allowed: Sequence[str]) -> None:
    if not isinstance(node, DictConfig):
        return
    for key in node.keys():
        key = str(key)
        if key.startswith("_"):
            continue
        if key not in allowed:
            raise UserError(unknown_key_message(f"{prefix}.{key}", allowed))


def _target_arguments(key: str, target: str) -> Optional[list[str]]:
    """The keyword arguments a `_target_` accepts, or None when it takes **kwargs (or cannot be inspected)."""
    from hydra.utils import get_object

    hydra_log = logging.getLogger("hydra.utils")  # get_object logs its error on several lines: the UserError says it
    quiet, hydra_log.disabled = hydra_log.disabled, True
    try:
        obj = get_object(target)
    except Exception as err:
        cause = err.__cause__ or err  # what failed, under Hydra's "Error loading ..." ImportError
        raise UserError(f"{key}._target_={target!r} cannot be imported ({type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}); check the class path") from None
    finally:
        hydra_log.disabled = quiet
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]


def _check_target_keys(cfg: DictConfig, key: str) -> None:
    """The node's `_target_` imports, and (unless a schema types the node) takes each of the node's keys."""
    node = _select(cfg, key)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    allowed = _target_arguments(key, str(node["_target_"]))
    if allowed is not None and _schema_of(node) is None:
        _check_keys(node, key, allowed)


def _schema_of(node: DictConfig) -> Optional[type]:
    schema = OmegaConf.get_type(node)
    return schema if dataclasses.is_dataclass(schema) else None


def _typed_nodes(node: Any, key: str = "") -> Iterator[tuple[str, DictConfig]]:
    """(key, node) of every node typed by a schema; the hydra node is Hydra's, not searched."""
    if not isinstance(node, DictConfig):
        return
    if _schema_of(node) is not None:
        yield key, node
        return
    for name, child in node.items_ex(resolve=False):
        if key or name != "hydra":
            yield from _typed_nodes(child, f"{key}.{name}" if key else str(name))


def _check_schema_keys(node: DictConfig, key: str) -> None:
    """No key outside the node's schema, nor outside the schemas of its typed children (callbacks.checkpoint.keep)."""
    names = [spec.name for spec in dataclasses.fields(_schema_of(node)) if not spec.name.startswith("_")]
    _check_keys(node, key, names)
    for name, child in node.items_ex(resolve=False):
        if isinstance(child, DictConfig) and _schema_of(child) is not None:
            _check_schema_keys(child, f"{key}.{name}")


def built(cfg: DictConfig, key: str) -> Any:
    """The dataclass instance of a structured-config node (its `__post_init__` checks the values), or the node as
    plain types when it has no schema. An interpolation that does not resolve is one line naming the key."""
    node = _select(cfg, key)
    if not isinstance(node, DictConfig):
        return _plain(node)
    try:
        return OmegaConf.to_object(node)
    except UserError:
        raise
    except Exception as err:
        full_key = getattr(err, "full_key", None) or key
        raise UserError(f"{full_key} does not resolve: {str(err).splitlines()[0]}") from None


def _check_experiment(cfg: DictConfig, evaluations: Optional[ColumnOwners]) -> None:
    """A preset's claims (`claims.parse_claims`, against the columns of `evaluations`) are well formed; a preset
    with labelled variants (experiment.variants, picked by experiment.variant, often per scale): the label and the
    scale must be among its entries."""
    exp = cfg.get("experiment")
    if not isinstance(exp, DictConfig):
        return
    # its baseline and claims (what `sinklab report` tests) are well formed
    parse_claims(_plain(OmegaConf.masked_copy(exp, [k for k in ("baseline", "claims") if k in exp])), evaluations)
    # a preset whose models start from others' (a second stage's from a first stage's sweep, or from a model no
    # preset trains: experiment.starts_from says which) needs init_from
    starts = {"first_stage": lambda v: (f"the models of experiment={v}", f"init_from=SWEEP_DIR of `sinklab-train -m "
                                        f"experiment={v}` (each job starts from the job with its settings and seed), "
                                        "or a run dir or .ckpt"),
              "starts_from": lambda v: (str(v), "init_from=RUN_DIR of that model")}
    for key, words in starts.items():
        if exp.get(key) is not None and not cfg.get("init_from"):
            source, allowed = words(exp.get(key))
            raise UserError(f"init_from is missing: experiment={exp.get('name', '?')} starts from {source}; "
                            f"allowed: {allowed}")
    variants = exp.get("variants")
    if not isinstance(variants, DictConfig):
        return
    name, variant = exp.get("name", "?"), exp.get("variant")
    if variant not in variants:
        raise UserError(f"experiment.variant={show(_plain(variant))} is not a variant of experiment={name}; "
                        f"allowed: {', '.join(map(str, variants.keys()))}")
    entry, scale = variants[variant], _select(cfg, "scale.name")
    scales = sorted(p.stem for p in (CONF_DIR / "scale").glob("*.yaml"))
    given = [str(k) for k in entry.keys() if str(k) in scales] if isinstance(entry, DictConfig) else []
    if given and scale not in given:
        chosen = f"scale={scale}" if scale is not _MISSING else "no scale (~scale)"
        raise UserError(f"experiment={name} has no settings for {chosen}; allowed: "
                        f"{', '.join(f'scale={s}' for s in given)}")


def validate_config(cfg: DictConfig, evaluations: Optional[ColumnOwners] = None) -> ModelConfig:
    """Refuse bad training configs with one line naming the key, the value and what is allowed; a claim of the
    experiment preset that names an evaluation's column is checked against `evaluations` (sinklab-train hands
    `sinklab.evals.EVALUATIONS`)."""
    model_node = _select(cfg, "model")
    if not isinstance(model_node, DictConfig):
        raise UserError(f"model={show(_plain(model_node))} is not a model config; choose a preset: model=tiny, "
                        "model=14m, model=60m or model=1b")
    unknown = [str(k) for k in cfg.keys() if str(k) not in ROOT_KEYS]
    if unknown:
        raise UserError(unknown_key_message(unknown[0], ROOT_KEYS))
    _check_experiment(cfg, evaluations)
    # the hydra node (present in configs composed with return_hydra_config) is Hydra's: its sweep dir
    # interpolates hydra.job.num, which is only set inside a job, so it is not searched
    missing = sorted(OmegaConf.missing_keys(OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])))
    if missing:
        raise UserError(f"{missing[0]} has no value (??? in its config) and is required; set it on the command "
                        f"line, e.g. {missing[0]}=...")
    for key, (check, required) in SCHEMA.items():
        _check_value(cfg, key, check, required)
    # every typed node (model, optim, trainer, sinklab's callbacks, ...): no key outside its schema (Hydra lets
    # `+key=value` into a typed node), and its rules (`built` runs the dataclass's __post_init__)
    objects = {}
    for key, node in _typed_nodes(cfg):
        _check_schema_keys(node, key)
        objects[key] = built(cfg, key)
    mcfg = objects["model"] if isinstance(objects.get("model"), ModelConfig) else built(cfg, "model")
    # option names: Hydra refuses unknown keys on the command line; these catch them in preset files too
    _check_target_keys(cfg, "trainer")
    _check_target_keys(cfg, "data")
    for group in ("callbacks", "logger"):
        node = _select(cfg, group)
        if isinstance(node, DictConfig):
            for name in node.keys():
                _check_target_keys(cfg, f"{group}.{name}")
    # combinations
    if mcfg.compile and _select(cfg, "compile_backend") is not _MISSING:
        from sinklab.model.compile import check_compile_backend

        check_compile_backend(_plain(_select(cfg, "compile_backend")))
    block = _select(cfg, "data.block_size")
    if is_int(block) and block > mcfg.block_size:
        raise UserError(f"data.block_size={block} exceeds the model context model.block_size={mcfg.block_size}; "
                        f"allowed: 1..{mcfg.block_size}")
    k, probe_len = _select(cfg, "callbacks.sink.k"), _select(cfg, "data.probe_seq_len")
    if _select(cfg, "callbacks.sink") not in (None, _MISSING) and is_int(probe_len) and probe_len > mcfg.block_size:
        # the sink callback measures the model on the probe
        raise UserError(f"data.probe_seq_len={probe_len} exceeds the model context model.block_size="
                        f"{mcfg.block_size}; allowed: 1..{mcfg.block_size} (`sinklab measure --past-context` reads a "
                        "trained model past its context)")
    if _select(cfg, "callbacks.sink") not in (None, _MISSING) and is_int(k) and is_int(probe_len) \
            and k > probe_len:
        raise UserError(f"callbacks.sink.k={k} exceeds the probe length data.probe_seq_len={probe_len}; "
                        f"allowed: 1..{probe_len}")
    return mcfg


def check_devices(cfg: DictConfig) -> None:
    """The trainer's accelerator exists on this machine (a GPU preset on a CPU node fails here, before any data is
    loaded, instead of in Lightning after it)."""
    accelerator = _select(cfg, "trainer.accelerator")
    devices = _select(cfg, "trainer.devices")
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise UserError(f"trainer.accelerator={accelerator}: this machine has no CUDA GPU; allowed here: "
                        "trainer=cpu or trainer=ddp_cpu (or trainer.accelerator=cpu)")
    if is_int(devices) and devices > have:
        raise UserError(f"trainer.devices={devices}: this machine has {have} GPU(s); allowed: 1..{have} or auto")
