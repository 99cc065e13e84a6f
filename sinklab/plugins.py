"""Components and metrics from a user's own package, without editing sinklab.

A plugin is a Python module that registers attention operations, positions, norms, ... (`@ATTENTION_OPS.register`)
and metrics (`@METRICS.register`) when it is imported. sinklab imports the modules named
- by the entry-point group `sinklab.plugins` of every installed package (`pyproject.toml`:
  `[project.entry-points."sinklab.plugins"]  myop = "mypkg.ops.myop"`): nothing to set;
- in the environment variable SINKLAB_PLUGINS (module names separated by commas): code on PYTHONPATH, not installed;
- by sinklab-train's `plugins=mypkg.ops.myop` (or `plugins=[a,b]`) on the command line, which also exports them
  in SINKLAB_PLUGINS for the jobs and commands the run starts.
`sinklab-train`, every `sinklab` command and `sinklab.load_model` load them before the config is composed or a
model is built. A component registered after `ModelConfig` was built adds its knobs to it in place
(`sinklab.model.config.add_knobs`), so the import order does not matter. Each component of a plugin is an option of
its config group (`model/attn=myop`) in Hydra's ConfigStore, and the yaml files in `conf/model/<group>/` of the
plugin's top-level package are options of those groups too (a variant with its knob values). docs/extending.md,
"Add a component from your own package".

Only the user names plugins: a checkpoint records the modules its run loaded (`sinklab_plugins`), and loading it
checks them but never imports them (`sinklab.runs.checkpoints.model_config`), since a file must not choose the code that
runs. A plugin module that raises while it is imported has a bug of its own: `PluginImportError` names it and where
it was named, and the commands print that line above the module's own traceback (`show_import_failure`).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import traceback
from typing import Any, Sequence

from sinklab.errors import UserError

ENTRY_POINT_GROUP = "sinklab.plugins"
ENV = "SINKLAB_PLUGINS"
LOADED: list[str] = []  # the plugin modules imported by load_plugins, in order (a checkpoint records them)


class PluginImportError(Exception):
    """A plugin module raised while it was imported (its own code, or a package it imports that is missing): its
    bug, not a usage error. The message names the module and where it was named; the cause is its exception."""


def named_modules(extra: Sequence[str] = (), where: str = "plugins=") -> list[tuple[str, str]]:
    """(module, where it is named) for every plugin module: entry points, SINKLAB_PLUGINS, then `extra`."""
    named = [(ep.module, f"entry point {ep.name!r} of group {ENTRY_POINT_GROUP}")
             for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]
    named += [(m, ENV) for m in split(os.environ.get(ENV, ""))]
    return named + [(m, where) for m in extra]


def split(text: str) -> list[str]:
    return [m.strip() for m in text.strip().strip("[]").split(",") if m.strip()]


def load_plugins(extra: Sequence[str] = (), where: str = "plugins=") -> list[str]:
    """Import every plugin module once (idempotent). A module that cannot be found, or whose components clash with
    sinklab's (a UserError raised while registering), is one UserError line; any other exception raised while it is
    imported is a PluginImportError naming the module and where it was named, caused by that exception."""
    for module, source in named_modules(extra, where):
        if module in LOADED:
            continue
        try:
            importlib.import_module(module)
        except UserError:
            raise
        except ModuleNotFoundError as err:
            if err.name is None or not (module == err.name or module.startswith(err.name + ".")):
                raise import_failure(module, source, err) from err  # the plugin imports something missing
            raise UserError(f"plugin module {module!r} (named by {source}) cannot be imported: {err}; pip install "
                            f"its package or put it on PYTHONPATH") from None
        except Exception as err:
            raise import_failure(module, source, err) from err
        LOADED.append(module)
    return LOADED


def import_failure(module: str, source: str, err: Exception) -> PluginImportError:
    return PluginImportError(f"plugin module {module!r} (named by {source}) raised {type(err).__name__} while it was "
                             "imported; its traceback follows")


def show_import_failure(prog: str, err: PluginImportError) -> None:
    """What a command prints for a plugin that failed on import: the line naming it, then its own traceback (from
    the plugin's first frame: the import machinery's frames above it are not the user's)."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    cause = err.__cause__
    tb = cause.__traceback__
    machinery = (__file__, importlib.__file__)
    while tb is not None and tb.tb_next is not None and (tb.tb_frame.f_code.co_filename in machinery or
                                                         tb.tb_frame.f_code.co_filename.startswith("<frozen ")):
        tb = tb.tb_next
    traceback.print_exception(type(cause), cause, tb, file=sys.stderr)


def from_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """sinklab-train's `plugins=a,b` / `plugins=[a,b]` (or `+plugins=...`): (the modules, the other arguments)."""
    modules, rest = [], []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == "plugins":
            modules += split(value)
        else:
            rest.append(arg)
    return modules, rest


def use_from_command_line(argv: list[str]) -> list[str]:
    """Load the plugins of a command line and of the environment; the modules named on the command line go into
    SINKLAB_PLUGINS (the jobs a launcher starts inherit them). Returns the arguments left for Hydra."""
    modules, rest = from_argv(argv)
    load_plugins(modules, where="plugins= on the command line")
    if modules:
        os.environ[ENV] = ",".join(dict.fromkeys(split(os.environ.get(ENV, "")) + modules))
    return rest


def is_plugin(obj: Any) -> bool:
    """A component or metric registered from outside sinklab."""
    return not (obj.__module__ == "sinklab" or obj.__module__.startswith("sinklab."))
