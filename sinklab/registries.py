"""The name -> class registry that every plug-in family of sinklab's library shares: metrics (`sinklab.metrics.METRICS`),
model sources (`sinklab.targets.SOURCES`) and evaluations (`sinklab.evals.EVALUATIONS`). A class registers under a
name with `@REGISTRY.register("name")`; registering another class under a name taken is refused; the registry keeps
the registration order (the order of `measure --json`, `sinklab eval --help`). The architecture components have
their own, config-aware `sinklab.model.registry.Registry` (one per config key, with config errors and knob
listeners)."""
from __future__ import annotations

from typing import Callable, ClassVar, Generic, Iterator, TypeVar

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

    def get(self, name: str) -> C:
        if name not in self._classes:
            raise self.unknown(f"{self.what} {name!r} is unknown; allowed: {', '.join(self._classes)}")
        return self._classes[name]
