"""The import graph of sinklab/: its packages stand on floors (`FLOORS`: no import from a floor above, no cycle);
commands sit on a shared base and never import each other, the library never imports a command, and what evaluates a
model sits below training (no Lightning for `sinklab quant` and `sinklab eval`).

Imports are read from the source (ast), wherever they are in a module (module level or inside a function), except
a module's `if __name__ == "__main__":` block: `python -m sinklab.analysis.measurement` running `sinklab.cli.measure` is a
command line, not a dependency.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from sinklab.model import ModelConfig, Transformer
from sinklab.registries import submodules

SINKLAB = Path(__file__).resolve().parents[2] / "sinklab"
CLI_BASE = {"sinklab.cli", "sinklab.cli.base"}  # the shared base and the dispatcher
# what loads, scores and evaluates a model: below sinklab.train, so that it runs without Lightning
BELOW_TRAIN = ("sinklab.evals", "sinklab.quant", "sinklab.metrics", "sinklab.model", "sinklab.config.validate",
               "sinklab.runs", "sinklab.targets", "sinklab.analysis", "sinklab.cli.base")
# what evaluates or analyses a model takes a sinklab.targets.Target: none of them knows where the model came from
OVER_TARGETS = ("sinklab.evals", "sinklab.analysis", "sinklab.quant")
# every module of sinklab/targets/ but the interface: the sources and their helpers
SOURCE_MODULES = tuple(m for m in submodules("sinklab.targets") if m != "sinklab.targets.interface")


def module_name(path: Path) -> str:
    parts = path.relative_to(SINKLAB.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_main_guard(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in test.comparators))


def imports(path: Path) -> set[str]:
    """Every module `path` imports (`from a.b import c` counts as a.b and a.b.c), relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if is_main_guard(child):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


@functools.lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    """{module: the sinklab modules it imports} of every module of sinklab/ (read once per process: the tests only
    read it)."""
    return {module_name(p): {m for m in imports(p) if m == "sinklab" or m.startswith("sinklab.")}
            for p in sorted(SINKLAB.rglob("*.py"))}


def commands() -> set[str]:
    return {m for m in graph() if m.startswith("sinklab.cli.") and m not in CLI_BASE}


def test_the_graph_reader_sees_imports_of_every_kind(tmp_path, monkeypatch):
    """The reader is what the rules below rest on: module-level, function-level and relative imports count, the
    `python -m` block does not."""
    pkg = tmp_path / "sinklab" / "cli"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("import sinklab.cli.b\nfrom . import c\nfrom .base import x\n"
                              "def f():\n    from sinklab.cli.d import main\n"
                              "if __name__ == '__main__':\n    from sinklab.cli.e import main\n")
    monkeypatch.setattr(sys.modules[__name__], "SINKLAB", tmp_path / "sinklab")
    assert imports(pkg / "a.py") == {"sinklab.cli.b", "sinklab.cli", "sinklab.cli.c", "sinklab.cli.base",
                                     "sinklab.cli.base.x", "sinklab.cli.d", "sinklab.cli.d.main"}


def test_every_command_is_a_module_of_the_cli_package():
    """`sinklab NAME` is the module of sinklab/cli/ named after it that declares a SUMMARY, with a main; every other
    module there is an evaluation's command."""
    from sinklab.cli import commands as top_level
    from sinklab.cli.eval import subcommands

    found = top_level()
    assert {"measure", "eval", "export-hf", "check-component"} <= set(found)
    for name, (module, summary) in found.items():
        assert module == "sinklab.cli." + name.replace("-", "_") and summary.strip(), name
        assert callable(importlib.import_module(module).main), module
    routed = {module for module, _ in [*found.values(), *subcommands().values()]}
    assert routed - commands() == set()
    assert commands() - routed == set(), "a module in sinklab/cli/ that no command routes to (no SUMMARY?)"


def test_a_declared_summary_is_read_without_importing_the_module(tmp_path, monkeypatch):
    from sinklab.registries import declared

    (tmp_path / "probe_cmd.py").write_text('import not_a_module_anywhere\nSUMMARY = ("one line, "\n'
                                            '           "written on two")\nOTHER: int = 3\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert declared("probe_cmd", "SUMMARY") == "one line, written on two"
    assert declared("probe_cmd", "OTHER") == 3 and declared("probe_cmd", "MISSING") is None
    assert "probe_cmd" not in sys.modules


def test_no_command_imports_another():
    g, cmds = graph(), commands()
    for cmd in sorted(cmds):
        others = {m for m in g[cmd] for other in cmds - {cmd} if m == other or m.startswith(other + ".")}
        assert not others, f"{cmd} imports the command(s) {sorted(others)}: move what they share to sinklab.cli.base " \
                           "or the library"


def test_the_library_never_imports_a_command():
    for module, deps in graph().items():
        if module.startswith("sinklab.cli") or module.endswith("__main__"):
            continue
        up = sorted(m for m in deps if m == "sinklab.cli" or m.startswith("sinklab.cli."))
        assert not up, f"{module} imports {up}: commands are the top of the graph"


def test_evaluation_sits_below_training():
    for module, deps in graph().items():
        if module.startswith(BELOW_TRAIN):
            up = sorted(m for m in deps if m == "sinklab.train" or m.startswith("sinklab.train."))
            assert not up, f"{module} imports {up}: it must run without sinklab.train (and Lightning)"


def test_no_evaluation_or_analysis_branches_on_the_model_source():
    """Evaluations and analyses reach a model through `sinklab.targets` only (`Target`, `load_target`): they import
    no source's module and compare nothing with a source's name."""
    from sinklab.targets import SOURCES

    names = set(SOURCES.names())
    assert {"sinklab", "hf"} <= names
    for module, deps in graph().items():
        if not module.startswith(OVER_TARGETS):
            continue
        direct = sorted(m for m in deps if m.startswith(SOURCE_MODULES))
        assert not direct, f"{module} imports {direct}: take a Target (sinklab.targets) instead"
        path = SINKLAB.parent / (module.replace(".", "/") + (".py" if (SINKLAB.parent / (module.replace(".", "/")
                                                                                       + ".py")).exists() else "/__init__.py"))
        compared = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Compare)
                    and any(isinstance(c, ast.Constant) and c.value in names for c in [n.left, *n.comparators])]
        assert not compared, f"{module}:{compared[0].lineno} compares with a source's name: a Target method instead"


def test_nll_and_perplexity_are_written_once():
    """One mean NLL and one perplexity (sinklab.model.lm_loss); training, the commands and the evaluations call them."""
    for path in [p for d in ("cli", "evals", "quant", "train") for p in (SINKLAB / d).rglob("*.py")]:
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not defined & {"mean_nll", "perplexity", "next_token_targets"}, path
        exps = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "exp"
                and isinstance(n.value, ast.Name) and n.value.id == "math"]
        assert not exps, f"{path}: math.exp of a loss is sinklab.model.lm_loss.perplexity"


def test_perplexity_overflow_guard():
    import math

    from sinklab.model.lm_loss import perplexity

    assert perplexity(2.0) == math.exp(2.0)
    assert perplexity(705.0) == math.exp(705.0) < math.inf  # representable: exact, no early cut-off
    assert perplexity(710.0) == math.inf
    assert math.isnan(perplexity(float("nan")))
    nll = torch.tensor([1.0, 2.0, 4.0])
    assert perplexity(nll) == math.exp(float(nll.double().mean()))


# run after a program's code: exit 3 when it imported Lightning
NO_LIGHTNING = ("\nimport sys\nbad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', "
                "'pytorch_lightning'))\nif bad:\n    print('imported', bad[:5], file=sys.stderr)\n    sys.exit(3)\n")


def run_without_lightning(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python, then fail (exit 3) when it imported Lightning."""
    return subprocess.run([sys.executable, "-c", code + NO_LIGHTNING], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_quant_and_eval_commands_import_no_lightning():
    proc = run_without_lightning("import sinklab.cli, sinklab.cli.quant, sinklab.cli.eval, sinklab.cli.streaming, "
                                 "sinklab.cli.intervene, sinklab.cli.measure, sinklab.cli.sample, sinklab.model.lm_loss, "
                                 "sinklab.config.validate")
    assert proc.returncode == 0, proc.stderr
    # the check itself: a module that does import Lightning is caught (in this process, where the tests' training
    # runs import it anyway, instead of a second fresh Python that imports it)
    import sinklab.train.module  # noqa: F401

    with pytest.raises(SystemExit) as caught, contextlib.redirect_stderr(io.StringIO()) as err:
        exec(NO_LIGHTNING, {})
    assert caught.value.code == 3 and err.getvalue().startswith("imported ['lightning")


def test_the_dispatcher_loads_no_command_and_no_torch():
    """`sinklab --help` imports a command's module only when it runs, and the base imports torch only to pick a
    device."""
    code = ("import sys, contextlib, io\nfrom sinklab.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['--help'])\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('sinklab.cli.') and m != 'sinklab.cli.base')\n"
            "sys.exit(f'loaded {loaded}, torch: {\"torch\" in sys.modules}' if loaded or 'torch' in sys.modules "
            "else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_quant_and_streaming_run_without_lightning(tmp_path):
    """`sinklab quant` and `sinklab eval streaming` of a checkpoint on a token file, end to end, load no Lightning
    (a run's own data is read through its Lightning data module; a token file is not)."""
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, d_ff=32, block_size=16).validate()
    torch.manual_seed(0)
    ckpt = tmp_path / "m.ckpt"
    model = Transformer(cfg)
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model": cfg.to_dict(), "optim": {}, "max_steps": 1}}, ckpt)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "seqs.npy", rng.integers(0, 64, (4, 17)))
    np.save(tmp_path / "text.npy", rng.integers(0, 64, (40,)))
    out = tmp_path / "out.json"
    argvs = [["quant", str(ckpt), "--tokens", str(tmp_path / "seqs.npy"), "--schemes", "w8a8"],
             ["eval", "streaming", str(ckpt), "--tokens", str(tmp_path / "text.npy"), "--first", "1", "--recent", "8"]]
    proc = run_without_lightning(textwrap.dedent(f"""
        import contextlib, io, json
        from sinklab.cli import main
        codes, buf = [], io.StringIO()
        with contextlib.redirect_stdout(buf):
            for argv in {argvs!r}:
                codes.append(main(argv + ["--device", "cpu", "--json"]))
        open({str(out)!r}, "w").write(json.dumps([*codes, buf.getvalue().splitlines()]))"""))
    assert proc.returncode == 0, proc.stderr
    q, s, lines = json.loads(out.read_text())
    assert (q, s) == (0, 0)
    assert set(json.loads(lines[0])["schemes"]) == {"fp32", "w8a8"}
    assert json.loads(lines[1])["settings"][0]["name"] == "x=1 y=8"


# the packages of sinklab/ from the ground up: a module imports from its own floor and below only (the root's facade,
# sinklab/__init__.py, excepted: `sinklab.load_model` hands on sinklab.runs' own)
FLOORS = (("sinklab.errors", "sinklab.keys", "sinklab.registries", "sinklab.stats"),
          ("sinklab.model", "sinklab.plugins", "sinklab.io"), ("sinklab.metrics", "sinklab.quant"), ("sinklab.config",),
          ("sinklab.contracts", "sinklab.data"), ("sinklab.runs",), ("sinklab.targets",), ("sinklab.evals",),
          ("sinklab.report",), ("sinklab.analysis",), ("sinklab.export", "sinklab.train"),
          ("sinklab.cli", "sinklab.__main__"))


def floor(module: str) -> int:
    found = [i for i, names in enumerate(FLOORS) for name in names if module == name or module.startswith(name + ".")]
    assert found, f"{module} is on no floor of FLOORS: add its package there"
    return found[0]


def test_no_module_imports_from_a_floor_above_its_own():
    for module, deps in graph().items():
        if module == "sinklab":
            continue
        up = sorted(m for m in deps if m in graph() and m != "sinklab" and floor(m) > floor(module))
        assert not up, f"{module} imports {up}, from above its floor: move the shared piece down, or have the " \
                       "caller hand it in"


def test_no_import_cycle():
    """No circle of imports between modules (a package's `__init__` handing on its modules' names is not one)."""
    g = graph()
    own = {m: {d for d in deps if d in g and d != m and not m.startswith(d + ".")} for m, deps in g.items()}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + (module,)))
        if module in done:
            return
        for dep in sorted(own[module]):
            visit(dep, path + (module,))
        done.add(module)

    for module in sorted(g):
        visit(module, ())
