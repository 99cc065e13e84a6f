"""How sinklab finds its plug-ins, and the name -> class registry its library families share.

`discover(package)` imports every module of a package, and each module registers what it declares when it is
imported: the one way sinklab finds its metrics, evaluations, model sources, KV-cache policies, attention operations
and the model's other components, so that a new module is a new entry with no list to edit. `sinklab`'s commands are
the modules of `sinklab.cli` found the same way (`submodules`), each read without importing it (`declared`).

`NameRegistry`: a class registers under a name with `@REGISTRY.register("name")`; registering another class under a
name taken is refused; the registry keeps the registration order (the order of `measure --json`, `sinklab eval
--help`). The architecture components have their own, config-aware `sinklab.model.registry.Registry` (one per config
key, with config errors and knob listeners)."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ClassVar, Generic, Iterator, TypeVar


def submodules(package: str) -> list[str]:
    """The full names of the modules and subpackages directly in `package` (imported for its path), in name order;
    names starting with "_" are left out."""
    path = importlib.import_module(package).__path__
    return [f"{package}.{m.name}" for m in sorted(pkgutil.iter_modules(path), key=lambda m: m.name)
            if not m.name.startswith("_")]


def declared(module: str, name: str) -> Any:
    """The literal value `module` assigns to `name` at its top level (`SUMMARY = "..."`), read from its source
    without importing it; None where it assigns none. What a listing reads where importing every module would cost
    too much (`sinklab --help` imports no command)."""
    source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    return None


def discover(package: str, keep: Callable[[str], bool] = lambda name: True) -> list[ModuleType]:
    """Import every module of `package` (`submodules`) that `keep` takes, by its full name: each registers what it
    declares. Returns the modules, in name order; a module imported earlier (a family's first entry, imported first
    so that it is listed first) is imported once."""
    return [importlib.import_module(name) for name in submodules(package) if keep(name)]


C = TypeVar("C", bound=type)


class NameRegistry(Generic[C]):
    """name -> class, in registration order. A family sets `what` (how its errors name a member), `attribute` (the
    class attribute that receives the name) and `unknown` (the error `get` raises for a name not registered), and
    may refuse a class in `check`."""

    what: ClassVar[str] = ""
    attribute: ClassVar[str] = "name"
    unknown: ClassVar[type[Exception]] = KeyError

    def __init__(self):
        self._classes: dict[str, C] = {}

    def check(self, name: str, cls: C) -> None:
        """Refuse, with a ValueError, a class that cannot be registered under `name` (nothing by default)."""

    def register(self, name: str) -> Callable[[C], C]:
        def deco(cls: C) -> C:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.what} {name!r} is already registered by {self._classes[name].__module__}")
            self.check(name, cls)
            setattr(cls, self.attribute, name)
            self._classes[name] = cls
            return cls
        return deco

    def __iter__(self) -> Iterator[C]:
        return iter(list(self._classes.values()))

    def __contains__(self, name: str) -> bool:
        return name in self._classes

    def names(self) -> list[str]:
        return list(self._classes)

    def allowed(self, keep: Callable[[C], bool] = lambda cls: True) -> str:
        """The registered names whose class `keep` takes, comma-separated: what a help text or an error lists."""
        return ", ".join(name for name, cls in self._classes.items() if keep(cls))

    def get(self, name: str) -> C:
        if name not in self._classes:
            raise self.unknown(f"{self.what} {name!r} is unknown; allowed: {self.allowed()}")
        return self._classes[name]
