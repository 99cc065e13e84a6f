"""The generic contract checks of components (`components.py`) and metrics (`metrics.py`), importable so that
sinklab's own tests (tests/model/test_contracts.py, tests/metrics/test_metric_contracts.py), `sinklab check-component` (`command.py`)
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
    from sinklab.contracts import components, metrics
    from sinklab.metrics import METRICS
    from sinklab.model.registry import FAMILIES
    from sinklab.plugins import load_plugins

    load_plugins(modules, where=where)
    runs = [components.runs(cls) for family in FAMILIES for cls in family if owned_by(cls, modules)]
    runs += [metrics.runs(cls) for cls in METRICS if owned_by(cls, modules)]
    if not runs:
        raise UserError(f"{', '.join(modules)} registers no component and no metric; allowed: a module that "
                        "registers with @ATTENTION_OPS.register(...) (or POSITIONS, NORMS, NORM_POSITIONS, FFNS, "
                        "GATES, ATTN_BIASES; sinklab.model.registry) or @METRICS.register(...) (sinklab.metrics.base)")
    return [check for run in runs for check in run]
