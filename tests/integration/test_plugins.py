"""Components from outside sinklab (sinklab/plugins.py): a researcher's package, written here in a temporary
directory and put on PYTHONPATH, brings an attention operation with a knob, a yaml option of its own and a metric;
`sinklab export-hf` exports the op as remote code that imports the package (refused for an op of a script).
It trains through `sinklab-train` (the op found through the entry-point group `sinklab.plugins` of an installed
distribution's metadata, the metric through `plugins=` on the command line), its checkpoint loads in a process that
names the plugins and is refused in one that does not, `sinklab check-component` (and the same checks in the user's
own pytest suite) passes it and fails a broken one, one line per failed check; a knob that clashes with sinklab's is
one line, a module that raises on import is named above its traceback; a sweep runs under submitit (slow)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from sinklab.contracts.metrics import SWITCHES as METRIC_SWITCHES
from sinklab.plugins import from_argv
from tests.helpers import FAST, assert_one_line_error, finish, run_cli, run_cli_in_one_process, start_cli, train

OPS = '''
"""Scaled sigmoid attention: sigmoid(scaled_alpha * logit - 2) on the visible keys."""
import dataclasses

import torch

from sinklab.model.ops.base import AttentionOp
from sinklab.model.registry import ATTENTION_OPS


@ATTENTION_OPS.register("scaled_sigmoid")
class ScaledSigmoid(AttentionOp):
    """sigmoid(alpha * logit - 2) per visible key, rows not normalised."""

    @dataclasses.dataclass
    class Knobs:
        scaled_alpha: float = 1.0  # alpha

    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = cfg.scaled_alpha

    def normalise(self, s, seen):
        return torch.sigmoid(self.alpha * s - 2.0) * seen
'''

METRIC = '''
"""The residual stream's RMS leaving each layer, mean over tokens: act/resid_rms, act/layer<i>/resid_rms."""
import torch

from sinklab.metrics.base import METRICS, NON_NEGATIVE, Metric


@METRICS.register("resid_rms")
class ResidRMS(Metric):
    records = frozenset({"h"})
    bounds = ((r"^act/(layer\\d+/)?resid_rms$", NON_NEGATIVE),)
    json_key = "resid_rms"
    headline = ("act/resid_rms",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.sums, self.count = [0.0] * ctx.n_layer, [0] * ctx.n_layer

    def update(self, layer, rec):
        rms = rec["h"].double().pow(2).mean(-1).sqrt()  # (B, T)
        self.sums[layer] += rms.sum().item()
        self.count[layer] += rms.numel()

    def result(self):
        by_layer = [s / max(n, 1) for s, n in zip(self.sums, self.count)]
        return {"mean": sum(by_layer) / len(by_layer), "by_layer": by_layer}

    @staticmethod
    def flatten(result):
        return {"act/resid_rms": result["mean"],
                **{f"act/layer{i}/resid_rms": v for i, v in enumerate(result["by_layer"])}}
'''

BROKEN = '''
"""An operation that looks at the future (it ignores the mask) and a metric that logs a key without bounds."""
import torch

from sinklab.metrics.base import METRICS, Metric
from sinklab.model.ops.base import AttentionOp
from sinklab.model.registry import ATTENTION_OPS


@ATTENTION_OPS.register("leaky")
class Leaky(AttentionOp):
    """sigmoid(logit) on every key, the future included."""

    def normalise(self, s, seen):
        return torch.sigmoid(s)


@METRICS.register("unbounded")
class Unbounded(Metric):
    records = frozenset({"h"})

    def update(self, layer, rec):
        self.value = rec["h"].abs().max().item()

    def result(self):
        return {"value": self.value}

    @staticmethod
    def flatten(result):
        return {"act/unbounded_max": result["value"]}
'''


def op_with_knob(name: str, knob: str) -> str:
    """A plugin module registering the attention operation `name` with the knob `knob` (a float, default 1.5); a
    knob named like one of sinklab's is one line (tests/integration/test_plugins_checkpoints.py in this process)."""
    return textwrap.dedent(f'''
        import dataclasses

        import torch

        from sinklab.model.ops.base import AttentionOp
        from sinklab.model.registry import ATTENTION_OPS


        @ATTENTION_OPS.register("{name}")
        class Op(AttentionOp):
            @dataclasses.dataclass
            class Knobs:
                {knob}: float = 1.5

            def normalise(self, s, seen):
                return torch.sigmoid(s) * seen
        ''')


RAISES = {"boom": 'raise RuntimeError("boom at import")\n',  # the plugin's own code fails
          "needs_missing": "import labext_missing_dependency  # noqa: F401\n"}  # a package it needs is missing


@pytest.fixture(scope="module")
def user_package(tmp_path_factory) -> Path:
    """A directory for PYTHONPATH: the package `labext` (ops, metrics, broken, conf/model/attn/scaled_sharp.yaml)
    and the metadata of an installed distribution declaring `labext.ops` in the entry-point group sinklab.plugins."""
    root = tmp_path_factory.mktemp("user")
    pkg = root / "labext"
    (pkg / "conf" / "model" / "attn").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, source in (("ops", OPS), ("metrics", METRIC), ("broken", BROKEN)):
        (pkg / f"{name}.py").write_text(textwrap.dedent(source))
    (pkg / "knob_window.py").write_text(op_with_knob("windowed", "window"))  # a field of ModelConfig
    for name, source in RAISES.items():
        (pkg / f"{name}.py").write_text(source)
    (pkg / "conf" / "model" / "attn" / "scaled_sharp.yaml").write_text(
        "# @package model\nattn_op: scaled_sigmoid\nscaled_alpha: 4.0\n")
    clash = root / "clashpkg"  # an option named like one of sinklab's files
    (clash / "conf" / "model" / "attn").mkdir(parents=True)
    (clash / "__init__.py").write_text("from labext.broken import Leaky  # noqa: F401\n")
    (clash / "conf" / "model" / "attn" / "relu.yaml").write_text("# @package model\nattn_op: leaky\n")
    info = root / "labext-0.1.dist-info"  # what `pip install` writes for the package's pyproject.toml
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labext\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sinklab.plugins]\nscaled_sigmoid = labext.ops\n")
    return root


def user_env(root: Path, **extra: str) -> dict[str, str]:
    """The environment with `root` on PYTHONPATH, SINKLAB_PLUGINS only where `extra` sets it."""
    env = {k: v for k, v in os.environ.items() if k != "SINKLAB_PLUGINS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore", **extra)
    return env


@pytest.mark.slow
@pytest.mark.ci
def test_an_external_op_and_metric_train_from_the_command_line(user_package, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", user_env(user_package)["PYTHONPATH"])
    monkeypatch.delenv("SINKLAB_PLUGINS", raising=False)
    out = tmp_path / "run"
    # the op through the entry point, its yaml option (scaled_alpha 4.0) overridden by the knob, the metric by plugins=
    train(out, "plugins=labext.metrics", "model/attn=scaled_sharp", "model.scaled_alpha=2.5", "trainer.max_steps=4",
          "trainer.val_check_interval=4", "callbacks.sink.every_n_steps=2",
          "callbacks.checkpoint.every_n_train_steps=4", process=True)
    config = OmegaConf.load(out / ".hydra" / "config.yaml")
    assert config.model.attn_op == "scaled_sigmoid" and config.model.scaled_alpha == 2.5
    logged = pd.read_csv(out / "metrics.csv")
    assert "act/resid_rms" in logged and "act/layer1/resid_rms" in logged
    values = logged["act/resid_rms"].dropna()
    assert len(values) >= 1 and all(math.isfinite(v) and v > 0 for v in values)
    # the checkpoint records its plugins, and loading it imports none: a process that names them (SINKLAB_PLUGINS)
    # measures the run with the user's metric (`sinklab measure RUN --json`) and loads the op with the knob's value;
    # one that names none is refused in one line naming them
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sinklab
        from sinklab.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as measured:
            rc = main(["measure", {str(out)!r}, "--json", "--num-seqs", "4"])
        op = sinklab.load_model({str(out)!r}).blocks[0].attn.op
        print(rc, json.loads(measured.getvalue())["resid_rms"]["mean"] > 0, type(op).__name__, op.alpha)""")
    (user_package / "labext-0.1.dist-info" / "entry_points.txt").rename(tmp_path / "entry_points.txt")
    try:  # the package importable, its entry point taken away
        named = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=user_env(user_package, SINKLAB_PLUGINS="labext.ops,labext.metrics"))
        unnamed = start_cli("sinklab", "measure", str(out), "--num-seqs", "4", env=user_env(user_package))
        loaded, refused = finish(named), finish(unnamed)
    finally:
        (tmp_path / "entry_points.txt").rename(user_package / "labext-0.1.dist-info" / "entry_points.txt")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["0", "True", "ScaledSigmoid", "2.5"], loaded.stdout
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
    assert "needs plugin module(s) that are not loaded: labext.ops, labext.metrics (model.attn_op=" \
           "'scaled_sigmoid' is not supported, model key(s) model.scaled_alpha unknown here)" in refused.stderr
    assert "SINKLAB_PLUGINS=labext.ops,labext.metrics sinklab ..." in refused.stderr


USER_TEST = '''
import pytest
from sinklab.contracts import checks

CHECKS = checks(["labext.ops", "labext.metrics"])


@pytest.mark.parametrize("what,run", CHECKS, ids=[what for what, _ in CHECKS])
def test_sinklab_contract(what, run):
    run()
'''


@pytest.fixture(scope="module")
def checked(user_package) -> dict:
    """`sinklab check-component` of the user's op and metric, then of the broken ones, one after the other in one
    process with the package on its path (each call checks the modules it names): {modules: (exit code, stdout,
    stderr)}."""
    calls = {"labext.ops labext.metrics": ["check-component", "labext.ops", "labext.metrics"],
             "labext.broken": ["check-component", "labext.broken"]}
    return dict(zip(calls, run_cli_in_one_process("sinklab", list(calls.values()), env=user_env(user_package))))


@pytest.mark.slow
@pytest.mark.ci
def test_check_component_passes_an_external_op_and_metric(user_package, checked, tmp_path):
    """`sinklab check-component`, and the same checks in the user's own pytest suite (sinklab.contracts.checks)."""
    (tmp_path / "test_user_contracts.py").write_text(USER_TEST)
    in_pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "test_user_contracts.py", "-k", "future or streamed"], cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=user_env(user_package))
    proc = checked["labext.ops labext.metrics"]
    user = finish(in_pytest)
    selected = 1 + len(METRIC_SWITCHES)  # the op's no-future check, the metric's streamed check on each switch
    assert user.returncode == 0 and f"{selected} passed," in user.stdout, user.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    n = int(last.split()[0])
    assert last.startswith(f"{n} of {n} contract checks passed for labext.ops, labext.metrics") and n >= 20, last
    assert "FAIL" not in proc.stdout


@pytest.mark.slow
@pytest.mark.ci
def test_check_component_fails_a_broken_op_and_metric_one_line_per_check(checked):
    proc = checked["labext.broken"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL ")]
    assert any(line.startswith("FAIL no information from the future: attn_op=leaky: AssertionError: changing "
                               "token 15 changes the logits before it") for line in failed), failed
    assert any(line.startswith("FAIL rows sum to one where claimed: attn_op=leaky: AssertionError: attention to "
                               "keys it cannot see") for line in failed), failed
    assert any("act/unbounded_max has no bounds" in line for line in failed), failed
    assert not any("trains a step" in line for line in failed), failed  # it still trains: only what is broken
    last = proc.stdout.strip().splitlines()[-1]
    total = int(last.split()[2])
    assert last.startswith(f"{total - len(failed)} of {total} contract checks passed for labext.broken"), last


@pytest.fixture(scope="module")
def refused(user_package) -> dict:
    """The sinklab-train calls of the tests below, each refused before training, one after another in one process
    with the user's package on the path (its entry point loaded for each, as in a process of its own; the clash,
    which imports labext.broken, last): {name: (exit code, stdout, stderr)}."""
    calls = {"typo": ["model/attn=scaled_sigmoid", "model.scaled_alpah=2"],
             "owner": ["model.scaled_alpha=2"],  # the op is not selected
             "window": ["plugins=labext.knob_window"],
             "raises": ["plugins=labext.needs_missing"],
             "clash": ["plugins=clashpkg"]}
    return dict(zip(calls, run_cli_in_one_process("sinklab-train", list(calls.values()), env=user_env(user_package))))


@pytest.mark.slow
@pytest.mark.ci
def test_a_bad_knob_or_plugin_is_one_line(user_package, refused, capsys):
    """`sinklab check-component` of a module without components needs no plugin: it runs in this process."""
    missing = start_cli("sinklab-train", env=user_env(user_package, SINKLAB_PLUGINS="labext.nope"))
    nothing = run_cli("sinklab", "check-component", "json", capsys=capsys)
    missing = finish(missing)
    typo, owner, window, clash = (refused[name] for name in ("typo", "owner", "window", "clash"))
    for proc in (typo, owner, missing, nothing, clash, window):
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert_one_line_error(proc.stderr)
    assert "model.scaled_alpah" in typo.stderr
    assert "model.scaled_alpha=2.0 applies to model.attn_op=scaled_sigmoid only" in owner.stderr
    assert missing.stderr.strip() == "error: plugin module 'labext.nope' (named by SINKLAB_PLUGINS) cannot be " \
        "imported: No module named 'labext.nope'; pip install its package or put it on PYTHONPATH"
    assert nothing.stderr.startswith("sinklab check-component: error: json registers no component and no metric; "
                                     "allowed: a module that registers a component with @<REGISTRY>.register(...)")
    from sinklab.model.registry import FAMILIES  # every family is named, from the registries (QK-norms included)
    assert all(f"{family.what} (model.{family.key})" in nothing.stderr for family in FAMILIES)
    assert clash.stderr.strip() == "error: model/attn=relu of a plugin has the name of sinklab's " \
        "model/attn/relu.yaml; rename the component or the plugin's yaml"
    assert window.stderr.strip() == "error: module labext.knob_window (model.attn_op=windowed) declares the knob " \
        "window, the name of ModelConfig's own field model.window; give the knob another name"


@pytest.mark.slow
@pytest.mark.ci
def test_a_plugin_that_raises_on_import_is_named_above_its_traceback(user_package, refused, tmp_path, monkeypatch,
                                                                    capsys):
    """Named by SINKLAB_PLUGINS (`sinklab`) and by plugins= (`sinklab-train`, `refused`), each in a process with the
    package on its path, and by an entry point (an installed distribution of its own, put on this process's path):
    the line naming the module and where, then its own traceback (from its own frame), exit code 1."""
    env = start_cli("sinklab", "components", env=user_env(user_package, SINKLAB_PLUGINS="labext.boom"))
    (tmp_path / "boomext").mkdir()
    (tmp_path / "boomext" / "__init__.py").write_text(RAISES["boom"])
    (tmp_path / "boomext-0.1.dist-info").mkdir()
    (tmp_path / "boomext-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: boomext\nVersion: 0.1\n")
    (tmp_path / "boomext-0.1.dist-info" / "entry_points.txt").write_text("[sinklab.plugins]\nboom = boomext\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SINKLAB_PLUGINS", raising=False)
    rc, out, err = run_cli("sinklab", "eval", "streaming", "--help")
    entry = subprocess.CompletedProcess([], rc, out, err)
    env, argv = finish(env), refused["raises"]
    cases = [(env, "sinklab components", "'labext.boom' (named by SINKLAB_PLUGINS) raised RuntimeError",
              "labext/boom.py", "RuntimeError: boom at import"),
             (argv, "sinklab-train", "'labext.needs_missing' (named by plugins= on the command line) raised "
                                     "ModuleNotFoundError", "labext/needs_missing.py",
              "ModuleNotFoundError: No module named 'labext_missing_dependency'"),
             (entry, "sinklab eval", "'boomext' (named by entry point 'boom' of group sinklab.plugins) raised "
                                     "RuntimeError", "boomext/__init__.py", "RuntimeError: boom at import")]
    for proc, prog, named, frame, last in cases:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr[-3000:]
        assert lines[0] == f"{prog}: error: plugin module {named} while it was imported; its traceback follows"
        assert lines[1] == "Traceback (most recent call last):" and frame in lines[2] and lines[-1] == last, lines
    assert "boomext" not in sys.modules


def test_plugins_on_the_command_line_are_taken_out_of_hydras_arguments():
    assert from_argv(["plugins=[a.b,c]", "model=14m", "+plugins=d"]) == (["a.b", "c", "d"], ["model=14m"])
    assert from_argv(["model.plugins_x=1"]) == ([], ["model.plugins_x=1"])


@pytest.mark.slow
def test_a_sweep_of_external_ops_runs_under_the_submitit_launcher(user_package, tmp_path):
    """`sinklab-train -m hydra/launcher=submitit_local plugins=...`: each job, in its own process, finds the plugin
    (SINKLAB_PLUGINS, exported by the entry point) and trains with its knob's value (~45 s)."""
    sweep = tmp_path / "sweep"
    proc = run_cli("sinklab-train", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
                   f"hydra.sweep.dir={sweep}", *FAST, "plugins=labext.metrics", "model/attn=scaled_sigmoid",
                   "model.scaled_alpha=1.5,3", "trainer.max_steps=3", "trainer.val_check_interval=3",
                   "callbacks.sink.every_n_steps=3", "callbacks.checkpoint.every_n_train_steps=3", process=True,
                   env=user_env(user_package))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for job, alpha in (("0", 1.5), ("1", 3.0)):
        assert OmegaConf.load(sweep / job / ".hydra" / "config.yaml").model.scaled_alpha == alpha
        assert "act/resid_rms" in pd.read_csv(sweep / job / "metrics.csv")


EXPORT = '''
import contextlib, io, json, sys
import torch
from sinklab.cli import main
from sinklab.model import ModelConfig, Transformer
from sinklab.model.ops.base import AttentionOp
from sinklab.model.registry import ATTENTION_OPS
from sinklab.plugins import load_plugins
from tests.helpers import save_ckpt

ROOT = sys.argv[1]
load_plugins()  # labext.ops, through its entry point


@ATTENTION_OPS.register("script_sigmoid")
class ScriptSigmoid(AttentionOp):  # defined in the script (__main__): nothing could import it elsewhere
    def normalise(self, s, seen):
        return torch.sigmoid(s) * seen


def tiny(**model):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=16, **model))


save_ckpt(tiny(attn_op="scaled_sigmoid", scaled_alpha=2.5), __import__("pathlib").Path(ROOT) / "p.ckpt")
print(main(["export-hf", ROOT + "/p.ckpt", ROOT + "/hf", "--no-tokenizer"]))
print(json.dumps(json.load(open(ROOT + "/hf/config.json"))["sinklab_plugins"]))
save_ckpt(tiny(attn_op="script_sigmoid"), __import__("pathlib").Path(ROOT) / "s.ckpt")
with contextlib.redirect_stderr(io.StringIO()) as err:
    print(main(["export-hf", ROOT + "/s.ckpt", ROOT + "/hf2", "--no-tokenizer"]))
print(err.getvalue().strip())
'''

LOAD = '''
import sys
import torch
import transformers

try:
    hf = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/hf", trust_remote_code=True)
except ImportError as err:
    print("ImportError:", err)
    raise SystemExit(0)
import sinklab

idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    ours, theirs = sinklab.load_model(sys.argv[1] + "/p.ckpt")(idx), hf(input_ids=idx).logits
print(type(hf.model.blocks[0].attn.op).__name__, float((ours - theirs).abs().max()))
'''


@pytest.mark.slow
@pytest.mark.ci
def test_a_plugins_component_is_exported_where_its_package_is_importable(user_package, tmp_path):
    """sinklab export-hf of the user's op: config.json names its module and distribution (labext==0.1), and a
    process where the package is installed (its entry point loads it) loads the export with trust_remote_code and
    gets the checkpoint's logits; where it is not, one line says which package to install or which module to name
    in SINKLAB_PLUGINS (the modeling file never imports a module because config.json names it). An op defined
    in a script (`__main__`) is refused in one line: nothing could import it where the export is loaded."""
    from tests.helpers import REPO

    env = user_env(user_package)
    env["PYTHONPATH"] += os.pathsep + str(REPO)
    exported = subprocess.run([sys.executable, "-c", EXPORT, str(tmp_path)], capture_output=True, text=True, env=env,
                              timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    lines = exported.stdout.strip().splitlines()[-4:]  # after what the first export printed
    assert lines[0] == "0" and json.loads(lines[1]) == {"labext.ops": "labext==0.1"}, exported.stdout
    assert lines[2] == "2" and lines[3] == (
        "sinklab export-hf: error: model.attn_op=script_sigmoid cannot be exported: its component is defined in module "
        "'__main__', which cannot be imported by name where the export is loaded; move it into a package "
        "(docs/extending.md, 'Add a component from your own package')"), exported.stdout
    assert not (tmp_path / "hf2").exists()

    without = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    without["PYTHONPATH"] = str(REPO)  # sinklab, not the user's package
    loads = [subprocess.Popen([sys.executable, "-c", LOAD, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=e) for e in (env, without)]
    (loaded, lo_err), (refused, re_err) = (p.communicate(timeout=300) for p in loads)
    assert loads[0].returncode == 0 and loaded.split()[0] == "ScaledSigmoid", lo_err[-3000:]
    assert float(loaded.split()[1]) <= 1e-5
    assert refused.strip() == ("ImportError: this model uses plugin module(s) 'labext.ops', which sinklab does not "
                               "import because a file names them: pip install labext==0.1 (its entry point loads "
                               "them) or set SINKLAB_PLUGINS=labext.ops"), re_err[-3000:]
