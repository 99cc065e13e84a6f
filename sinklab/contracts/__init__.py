"""The generic contract checks of components (`components.py`) and metrics (`metrics.py`), importable so that
sinklab's own tests (tests/test_contracts.py, tests/test_metric_contracts.py) and `sinklab check-component` (a
user's module, `command.py`) run the same code."""
