"""Validation before any compute is spent.

`validate_config` is the schema of every user-facing key: each bad value is refused with one line naming the key,
the value and what is allowed, before any data is loaded. `hydra_error_message` turns Hydra's own composition
errors (unknown keys, unknown config groups, bad override syntax) into one such line as well.
"""
from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from sinklab.errors import UserError
from sinklab.model.config import ModelConfig

from .store import CONF_DIR

__all__ = ["validate_config", "built", "check_devices", "hydra_error_message", "PREEMPTION_SIGNALS"]


# ---------------------------------------------------------------------------------------------- value checks
# A check takes the value and returns None when it is fine, else what is allowed ("an integer >= 1").
Check = Callable[[Any], Optional[str]]
_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: Optional[int] = None, optional: bool = False) -> Check:
    want = "an integer" + (f" >= {low}" if low is not None else "") + (" or null" if optional else "")

    def check(v: Any) -> Optional[str]:
        if v is None and optional:
            return None
        return None if _is_int(v) and (low is None or v >= low) else want
    return check


def number(gt: Optional[float] = None, ge: Optional[float] = None, lt: Optional[float] = None,
           le: Optional[float] = None, optional: bool = False) -> Check:
    bounds = [f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else "",
              f"< {lt:g}" if lt is not None else "", f"<= {le:g}" if le is not None else ""]
    want = "a number " + " and ".join(b for b in bounds if b) + (" or null" if optional else "")

    def check(v: Any) -> Optional[str]:
        if v is None and optional:
            return None
        ok = _is_num(v) and (gt is None or v > gt) and (ge is None or v >= ge) and \
            (lt is None or v < lt) and (le is None or v <= le)
        return None if ok else want.strip()
    return check


def choice(*allowed: Any) -> Check:
    def check(v: Any) -> Optional[str]:
        if any(v == a and type(v) is type(a) for a in allowed):
            return None
        if len(allowed) == 1:
            return _word(allowed[0])
        return "one of " + ", ".join(dict.fromkeys(_word(a) for a in allowed))
    return check


def _word(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def boolean(v: Any) -> Optional[str]:
    return None if isinstance(v, bool) else "true or false"


def string(optional: bool = False) -> Check:
    def check(v: Any) -> Optional[str]:
        if v is None and optional:
            return None
        return None if isinstance(v, str) and v else "a non-empty string" + (" or null" if optional else "")
    return check


def numbers(item: Check, length: Optional[int] = None, what: str = "") -> Check:
    def check(v: Any) -> Optional[str]:
        want = f"a list of {length or 'one or more'} {what}"
        if not isinstance(v, (list, tuple)) or not v or (length is not None and len(v) != length):
            return want
        return want if any(item(x) for x in v) else None
    return check


def either(*checks: Check) -> Check:
    def check(v: Any) -> Optional[str]:
        wants = [c(v) for c in checks]
        return None if any(w is None for w in wants) else " or ".join(wants)
    return check


PRECISIONS = ("auto", "64-true", "64", "32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "16-true",
              "bf16-true", "transformer-engine", "transformer-engine-float16")
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGCONT", "SIGHUP")
DEBUG_KEYS = ("nan_at_step",)

# key -> (check, required). A key whose parent node is absent or null (callbacks.sink=null) is not checked.
SCHEMA: dict[str, tuple[Check, bool]] = {
    "seed": (integer(0), True),
    "ckpt_path": (string(optional=True), False),
    "peak_flops": (either(choice("auto"), number(gt=0, optional=True)), False),
    "compile_backend": (string(), False),
    # trainer (the train loader is endless: steps, not epochs)
    "trainer.max_steps": (integer(1), True),
    "trainer.val_check_interval": (integer(1), False),
    "trainer.check_val_every_n_epoch": (choice(None), False),
    "trainer.limit_val_batches": (either(integer(0), number(ge=0, le=1)), False),
    "trainer.log_every_n_steps": (integer(1), False),
    "trainer.accumulate_grad_batches": (integer(1), False),
    "trainer.gradient_clip_val": (number(ge=0, optional=True), False),
    "trainer.num_nodes": (integer(1), False),
    "trainer.devices": (either(integer(1), choice("auto", -1), numbers(integer(0), what="device indices")), False),
    "trainer.precision": (choice(*PRECISIONS, 16, 32, 64), False),
    "trainer.num_sanity_val_steps": (integer(-1), False),
    "trainer.use_distributed_sampler": (choice(False), False),
    # data (types only; the data module checks the rest when it is built, still before reading any data)
    "data.batch_size": (integer(1), False),
    "data.block_size": (integer(1), False),
    "data.num_workers": (integer(0), False),
    "data.seed": (integer(0), False),
    "data.val_fraction": (number(gt=0, le=0.5), False),
    "data.val_num_blocks": (integer(1), False),
    "data.probe_num_seqs": (integer(1), False),
    "data.probe_seq_len": (integer(1), False),
    "data.max_unique_tokens": (integer(1, optional=True), False),
    "data.max_train_tokens": (integer(1, optional=True), False),
    "data.rebuild_cache": (boolean, False),
    "data.bos": (boolean, False),
    "data.fixed_token.position": (integer(1, optional=True), False),
    "data.fixed_token.token_id": (integer(0, optional=True), False),
    "data.probe_bos": (boolean, False),
    "data.probe_fixed_token": (boolean, False),
    # callbacks
    "callbacks.sink.every_n_steps": (integer(1), False),
    "callbacks.sink.k": (integer(1), False),
    "callbacks.sink.eps": (numbers(number(gt=0, lt=1), what="thresholds in (0, 1)"), False),
    "callbacks.sink.batch_size": (integer(1), False),
    "callbacks.sink.activations": (boolean, False),
    "callbacks.sink.heatmap": (boolean, False),
    "callbacks.checkpoint.every_n_train_steps": (integer(1, optional=True), False),
    "callbacks.checkpoint.save_on_exception": (choice(False), False),
    "callbacks.preemption.signals": (numbers(choice(*PREEMPTION_SIGNALS), what=f"of {', '.join(PREEMPTION_SIGNALS)}"),
                                     False),
    # loggers
    "logger.wandb.project": (string(), False),
    "logger.wandb.entity": (string(optional=True), False),
    "logger.wandb.name": (string(optional=True), False),
    "logger.wandb.group": (string(optional=True), False),
    # debugging knobs (+debug.nan_at_step=N)
    "debug.nan_at_step": (integer(0, optional=True), False),
}

# extra words for a refused value, where the reason is not obvious
WHY = {
    "trainer.max_steps": "(the train loader is endless, so training is bounded by steps)",
    "trainer.val_check_interval": "(steps between validations; the train loader is endless)",
    "trainer.check_val_every_n_epoch": "(the train loader is endless: use trainer.val_check_interval)",
    "trainer.use_distributed_sampler": "(the data module shards batches across ranks itself)",
    "callbacks.checkpoint.save_on_exception": "(it would overwrite last.ckpt with the state of a failed step)",
}


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
        why = f" {WHY[key]}" if key in WHY else ""
        raise UserError(f"{key}={_show(value)} is not allowed; allowed: {want}{why}")


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def unknown_key_message(key: str, allowed: Sequence[str], new: Optional[str] = None) -> str:
    """'optim.lrr is not an option (did you mean optim.lr?); allowed: ...'"""
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
    where = f" of {parent}" if parent else ""
    msg = f"{key} is not an option{where}{hint}; allowed: {', '.join(sorted(allowed))}"
    if new:
        msg += f"; to add a new key on purpose write +{new}"
    return msg


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
    try:
        obj = _import_object(target)
    except Exception as err:
        raise UserError(f"{key}._target_={target!r} cannot be imported ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); check the class path") from None
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]


def _import_object(path: str) -> Any:
    """'package.module.Class' -> the object (the longest importable module prefix, then attributes)."""
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as err:
            if err.name is not None and not ".".join(parts[:i]).startswith(err.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no module named {parts[0]!r}")


def _check_target_keys(cfg: DictConfig, key: str, injected: Sequence[str] = ()) -> None:
    node = _select(cfg, key)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    allowed = _target_arguments(key, str(node["_target_"]))
    if allowed is not None:
        _check_keys(node, key, [a for a in allowed if a not in injected])


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


def validate_config(cfg: DictConfig) -> ModelConfig:
    """Refuse bad training configs with one line naming the key, the value and what is allowed."""
    model_node = _select(cfg, "model")
    if not isinstance(model_node, DictConfig):
        raise UserError(f"model={_show(_plain(model_node))} is not a model config; choose a preset: model=tiny, "
                        "model=14m, model=60m or model=1b")
    mcfg = built(cfg, "model")
    built(cfg, "optim")
    # the hydra node (present in configs composed with return_hydra_config) is Hydra's: its sweep dir
    # interpolates hydra.job.num, which is only set inside a job, so it is not searched
    missing = sorted(OmegaConf.missing_keys(OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])))
    if missing:
        raise UserError(f"{missing[0]} has no value (??? in its config) and is required; set it on the command "
                        f"line, e.g. {missing[0]}=..." + (" (a list: data.files=[a.txt,b.jsonl])"
                                                          if missing[0] == "data.files" else ""))
    for key, (check, required) in SCHEMA.items():
        _check_value(cfg, key, check, required)
    # option names: Hydra refuses unknown keys on the command line; these catch them in preset files too
    _check_keys(_select(cfg, "debug"), "debug", DEBUG_KEYS)
    _check_target_keys(cfg, "trainer", injected=("callbacks", "logger"))
    _check_target_keys(cfg, "data")
    for group in ("callbacks", "logger"):
        node = _select(cfg, group)
        if isinstance(node, DictConfig):
            for name in node.keys():
                _check_target_keys(cfg, f"{group}.{name}")
    # combinations
    if mcfg.compile and _select(cfg, "compile_backend") is not _MISSING:
        from sinklab.train.module import check_compile_backend

        check_compile_backend(_plain(_select(cfg, "compile_backend")))
    block = _select(cfg, "data.block_size")
    if _is_int(block) and block > mcfg.block_size:
        raise UserError(f"data.block_size={block} exceeds the model context model.block_size={mcfg.block_size}; "
                        f"allowed: 1..{mcfg.block_size}")
    k, probe_len = _select(cfg, "callbacks.sink.k"), _select(cfg, "data.probe_seq_len")
    if _select(cfg, "callbacks.sink") not in (None, _MISSING) and _is_int(k) and _is_int(probe_len) \
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
    if _is_int(devices) and devices > have:
        raise UserError(f"trainer.devices={devices}: this machine has {have} GPU(s); allowed: 1..{have} or auto")


# ---------------------------------------------------------------------------------------------- Hydra's errors
def hydra_error_message(err: BaseException) -> str:
    """One line for a Hydra / OmegaConf composition error: the key or group, the value, and what is allowed."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException) and getattr(err, "missing_cfg_file", None):
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        options = list(getattr(err, "options", None) or [])
        if group:
            allowed = f"allowed: {', '.join(options)}" if options else f"conf/{group}/ has no configs"
            return f"{group}={name}: there is no config {err.missing_cfg_file}.yaml; {allowed}"
        return f"config {name!r} not found in {CONF_DIR}"
    if isinstance(err, OverrideParseException):
        what = str(getattr(err, "message", "") or err).splitlines()[0]
        return (f"cannot parse the override {getattr(err, 'override', '')!r}: {what} "
                "(quote values with special characters, e.g. 'data.files=[\"a b.txt\"]')")
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
    parent = getattr(cause, "parent_node", None)
    text = str(err)
    if full_key and "not in struct" in str(cause) and isinstance(parent, DictConfig):
        new = None
        for line in text.splitlines():
            if "use +" in line:
                new = line.split("use +", 1)[1].strip()
        allowed = [str(k) for k in parent.keys() if not str(k).startswith("_")]
        return unknown_key_message(str(full_key), allowed, new)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0])
    if full_key and not any(str(full_key) in line for line in lines):
        lines.append(f"key: {full_key}")
    keep = []
    for line in lines:
        if line.startswith("Config search path") or line.startswith("provider="):
            break
        keep.append(line)
    return "; ".join(keep) or type(err).__name__
