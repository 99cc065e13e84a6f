"""One line for every configuration error: an unknown key (with "did you mean"), Hydra's own composition errors
(unknown keys, unknown configs in a group, bad override syntax, a value or key a schema refuses), and the user errors
of a `_target_`'s constructor."""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Optional, Sequence

from omegaconf import DictConfig

from sinklab.errors import UserError, one_line

from .schema import field_check, refused, show
from .store import CONF_DIR, SCHEMA_NAME


def unknown_key_message(key: str, allowed: Sequence[str], new: Optional[str] = None) -> str:
    """'optim.lrr is not an option of optim (did you mean optim.lr?); allowed: ...'"""
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
    where = f" of {parent}" if parent else ""
    msg = f"{key} is not an option{where}{hint}; allowed: {', '.join(sorted(allowed))}"
    if new:
        msg += f"; to add a new key on purpose write +{new}"
    return msg


def unknown_key_error_message(err: BaseException, text: str) -> Optional[str]:
    """A key that its node does not have (an untyped node in struct mode, or a schema's): the node's keys, "did you
    mean", and Hydra's hint for adding a key on purpose (from the error's `text`). None for any other error."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key, parent = getattr(err, "full_key", None), getattr(err, "parent_node", None)
    if not (isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key and isinstance(parent, DictConfig)
            and re.search(r"Key '[^']*' (is )?not in", str(err))):
        return None
    new = next((line.split("use +", 1)[1].strip() for line in text.splitlines() if "use +" in line), None)
    return unknown_key_message(str(key), [str(k) for k in parent.keys() if not str(k).startswith("_")], new)


def schema_error_message(err: BaseException) -> Optional[str]:
    """Another OmegaConf error inside a node typed by a schema (a dataclass): a refused value with what its field
    allows, or the key with OmegaConf's reason. None outside typed nodes."""
    from omegaconf.errors import ValidationError

    schema, key = getattr(err, "object_type", None), getattr(err, "full_key", None)
    if not (dataclasses.is_dataclass(schema) and key):
        return None
    first = str(getattr(err, "msg", None) or err).splitlines()[0]
    name = getattr(err, "key", None)
    if isinstance(err, ValidationError) and name in {spec.name for spec in dataclasses.fields(schema)}:
        value = getattr(err, "value", None)
        return refused(str(key), value, *field_check(schema, name)) or \
            f"{key}={show(value)} is not allowed ({first})"
    return f"{key}: {first}"


def hydra_error_message(err: BaseException) -> str:
    """One line for a Hydra / OmegaConf composition error: the key or group, the value, and what is allowed."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException) and getattr(err, "missing_cfg_file", None):
        from .launchers import missing_plugin_message

        plugin = missing_plugin_message(str(err.missing_cfg_file))
        if plugin:
            return plugin
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        options = [o for o in getattr(err, "options", None) or [] if not o.endswith(SCHEMA_NAME)]  # not choices
        if group:
            allowed = f"allowed: {', '.join(options)}" if options else f"conf/{group}/ has no configs"
            return f"{group}={name}: there is no config {err.missing_cfg_file}.yaml; {allowed}"
        return f"config {name!r} not found in {CONF_DIR}"
    if isinstance(err, OverrideParseException):
        what = str(getattr(err, "message", "") or err).splitlines()[0]
        return (f"cannot parse the override {getattr(err, 'override', '')!r}: {what} "
                "(quote values with special characters, e.g. 'data.files=[\"a b.txt\"]')")
    cause = err.__cause__
    text = str(err)
    # of an override, the cause; of a preset file's key or value, the context (Hydra re-raises it as "In 'trainer/foo':
    # ConfigKeyError raised while composing config: ...")
    original = cause if cause is not None else err.__context__
    message = unknown_key_error_message(original, text) or schema_error_message(original)
    if message:
        preset = re.match(r"In '([^']+)'", text)
        return f"conf/{preset.group(1)}.yaml: {message}" if preset else message
    full_key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
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


def instantiate_user(node: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, with the user errors of a target's constructor (ours: UserError; Lightning's:
    MisconfigurationException) reported as themselves instead of inside Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, MisconfigurationException):
            target = node.get("_target_") if hasattr(node, "get") else None
            raise UserError(f"{target}: {one_line(cause)}") from None
        raise
