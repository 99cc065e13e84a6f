"""Value checks, their one-line refusal, and the base of the structured-config schemas.

A check takes a value and returns None when it is fine, else what is allowed ("an integer >= 1"); the same words
serve a value refused by a schema's rules and a value of the wrong type refused by OmegaConf when the config is
composed (`messages.hydra_error_message`). A schema field states its check once, with `rule(default, check)`;
`Schema.__post_init__` applies the checks of every field, and a schema adds its cross-field rules after them.
`with_arguments_of` extends a schema by every other argument of a library class (the Lightning Trainer).
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import math
import typing
from typing import Any, Callable, ClassVar, Optional, Sequence

from sinklab.errors import UserError, word

Check = Callable[[Any], Optional[str]]


def show(value: Any) -> str:
    """A value as the user would write it in an override, strings quoted: 'abc', null, true, 3, [0.3]."""
    return repr(value) if isinstance(value, str) else word(value)


def not_allowed(key: str, value: Any, want: str, why: str = "") -> str:
    """'trainer.max_steps=0 is not allowed; allowed: an integer >= 1 (why)'"""
    return f"{key}={show(value)} is not allowed; allowed: {want}" + (f" {why}" if why else "")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: Optional[int] = None, optional: bool = False) -> Check:
    want = "an integer" + (f" >= {low}" if low is not None else "") + (" or null" if optional else "")

    def check(v: Any) -> Optional[str]:
        if v is None and optional:
            return None
        return None if is_int(v) and (low is None or v >= low) else want
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
            return word(allowed[0])
        return "one of " + ", ".join(dict.fromkeys(word(a) for a in allowed))
    return check


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


# ---------------------------------------------------------------------------------------------- schemas
def rule(default: Any, check: Check, why: str = "") -> Any:
    """A schema field with its default and its check; `why` explains a refusal whose reason is not obvious."""
    metadata = {"check": check, "why": why}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def refused(key: str, value: Any, check: Optional[Check], why: str = "") -> Optional[str]:
    """The one-line refusal of `value` at `key`, None when the check passes (or there is none)."""
    want = check(value) if check is not None else None
    return None if want is None else not_allowed(key, value, want, why)


@dataclasses.dataclass
class Schema:
    """Base of a structured config: `KEY` is where its node sits in the training config (`trainer`,
    `callbacks.sink`); every field made with `rule` is checked when the node becomes an object
    (`OmegaConf.to_object`, which `validate_config` does for every typed node)."""

    KEY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            message = refused(f"{self.KEY}.{spec.name}", getattr(self, spec.name), spec.metadata.get("check"),
                              spec.metadata.get("why", ""))
            if message:
                raise UserError(message)


def _optional(hint: Any) -> tuple[Any, bool]:
    """(X, True) for Optional[X], else (hint, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and len(args) == 2 and type(None) in args:
        return (args[0] if args[1] is type(None) else args[1]), True
    return hint, False


_TYPE_CHECKS: dict[Any, Check] = {int: integer(), float: number(), bool: boolean, str: string()}


def field_check(schema: type, name: str) -> tuple[Optional[Check], str]:
    """(check, why) of a schema field: its rule's, else its type's (int, float, bool, str or an Enum, each optionally
    None); no check for other types."""
    spec = next(spec for spec in dataclasses.fields(schema) if spec.name == name)
    if "check" in spec.metadata:
        return spec.metadata["check"], spec.metadata.get("why", "")
    try:
        hint, optional = _optional(typing.get_type_hints(schema).get(name))
    except NameError:  # an annotation that does not evaluate: no check
        return None, ""
    check = choice(*(m.value for m in hint)) if isinstance(hint, type) and issubclass(hint, enum.Enum) \
        else _TYPE_CHECKS.get(hint)
    return (either(check, choice(None)) if check and optional else check), ""


def _omegaconf_type(hint: Any) -> Any:
    """The argument's type when OmegaConf can hold it (int, float, bool, str, each optionally None), else Any."""
    base, optional = _optional(hint)
    if base not in _TYPE_CHECKS:
        return Any
    return Optional[base] if optional else base


def with_arguments_of(target: Callable, base: type, name: str, skip: Sequence[str] = ()) -> type:
    """The schema `name`: the fields of `base` (sinklab's defaults and rules), then a field for each other keyword
    argument of `target` with the target's own default, so that every argument of a library class stays allowed.
    `skip`: arguments that are not configured (the entry point passes them)."""
    own = {spec.name for spec in dataclasses.fields(base)}
    hints = typing.get_type_hints(target)
    extra = [(arg, _omegaconf_type(hints.get(arg, Any)), dataclasses.field(default=param.default))
             for arg, param in inspect.signature(target).parameters.items()
             if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and arg not in own
             and arg not in skip and arg != "self"]
    # __module__: the caller's, where the schema is bound to `name` (pickle finds it there)
    namespace = {"__module__": base.__module__, "__doc__": base.__doc__}
    return dataclasses.make_dataclass(name, extra, bases=(base,), namespace=namespace)
