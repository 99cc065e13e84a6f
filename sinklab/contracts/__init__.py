"""The generic contract checks of components (`component_checks.py`) and metrics (`metrics.py`), importable so that
sinklab's own tests (tests/model/test_contracts.py, tests/metrics/test_metric_contracts.py), `sinklab check-component` (`sinklab.cli.check_component`)
and a user's own pytest suite run the same code:

    from sinklab.contracts import checks
    CHECKS = checks(["mypkg.ops.myop"])

    @pytest.mark.parametrize("what,run", CHECKS, ids=[what for what, _ in CHECKS])
    def test_sinklab_contract(what, run):
        run()
"""
from __future__ import annotations

from typing import Callable, Sequence

from sinklab.errors import UserError


def owned_by(obj: type, modules: Sequence[str]) -> bool:
    return any(obj.__module__ == m or obj.__module__.startswith(m + ".") for m in modules)


def checks(modules: Sequence[str], where: str = "sinklab.contracts.checks") -> list[tuple[str, Callable[[], None]]]:
    """(what, run) for every contract check of every component and metric that the modules (a package: its
    submodules too) register; the modules are imported first, as plugins."""
    from sinklab.contracts import component_checks, metrics
    from sinklab.metrics import METRICS
    from sinklab.model.registry import FAMILIES
    from sinklab.plugins import load_plugins

    load_plugins(modules, where=where)
    runs = [component_checks.runs(cls) for family in FAMILIES for cls in family if owned_by(cls, modules)]
    runs += [metrics.runs(cls) for cls in METRICS if owned_by(cls, modules)]
    if not runs:
        families = ", ".join(f"{family.what} (model.{family.key})" for family in FAMILIES)
        raise UserError(f"{', '.join(modules)} registers no component and no metric; allowed: a module that "
                        f"registers a component with @<REGISTRY>.register(...) of sinklab.model.registry, one of: "
                        f"{families}; or a metric with @METRICS.register(...) (sinklab.metrics.base)")
    return [check for run in runs for check in run]
