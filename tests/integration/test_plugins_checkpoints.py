"""A checkpoint never chooses the code that runs (sinklab.runs.checkpoints.model_config): the plugin modules it lists are
imported only when the user names them (entry points, SINKLAB_PLUGINS, plugins=). A planted module beside the
checkpoint, on the path, writes a file when it is imported: loading a checkpoint that names it is refused in one line
and the file is never written; named in SINKLAB_PLUGINS, it loads the checkpoint as before. And a plugin component
whose knob takes the name of one of sinklab's is one line naming its module, the knob and the owner."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sinklab
from sinklab.runs.checkpoints import PLUGINS, check_same_model, read_checkpoint
from sinklab.errors import UserError
from sinklab.model import ModelConfig
from sinklab.model.ops.base import AttentionOp
from sinklab.model.registry import ATTENTION_OPS
from tests.helpers import run_cli, save_ckpt, small_model

PLANTED = "planted_sinklab_op"  # a module name no other test imports
PLANTED_SOURCE = '''
"""Writes {marker} when imported, then registers the attention operation planted_op (knob planted_alpha)."""
import dataclasses
from pathlib import Path

import torch

from sinklab.model.ops.base import AttentionOp
from sinklab.model.registry import ATTENTION_OPS

Path({marker!r}).write_text("imported")


@ATTENTION_OPS.register("planted_op")
class PlantedOp(AttentionOp):
    @dataclasses.dataclass
    class Knobs:
        planted_alpha: float = 1.0

    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = cfg.planted_alpha

    def normalise(self, s, seen):
        return torch.sigmoid(self.alpha * s) * seen
'''


@pytest.fixture
def planted(tmp_path, monkeypatch) -> tuple[Path, Path, Path]:
    """(the dir holding the planted module, on sys.path; the file its import writes; a checkpoint of a model with
    its op that names it in sinklab_plugins). SINKLAB_PLUGINS is unset: the user names no plugin."""
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "imported.txt"
    (code / f"{PLANTED}.py").write_text(textwrap.dedent(PLANTED_SOURCE.format(marker=str(marker))))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delenv("SINKLAB_PLUGINS", raising=False)
    path = save_ckpt(small_model(), tmp_path / "run" / "planted.ckpt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["hyper_parameters"]["model"].update(attn_op="planted_op", planted_alpha=2.5)
    ckpt[PLUGINS] = [PLANTED]
    torch.save(ckpt, path)
    return code, marker, path


def assert_refused(message: str, path: Path) -> None:
    assert len(message.strip().splitlines()) == 1, message
    assert f"{path} needs plugin module(s) that are not loaded: {PLANTED} (model.attn_op='planted_op'" in message
    assert f"SINKLAB_PLUGINS={PLANTED} sinklab ..., or install the package that declares them" in message


def test_a_checkpoint_naming_a_module_is_refused_and_never_imports_it(planted, capsys):
    _, marker, path = planted
    with pytest.raises(UserError) as refused:
        sinklab.load_model(path)
    assert_refused(str(refused.value), path)
    rc, out, err = run_cli("sinklab", "measure", str(path), "--input", "random", "--num-seqs", "2")
    assert rc == 2 and out == ""
    assert_refused(err.removeprefix("sinklab measure: error: "), path)
    with pytest.raises(UserError) as resumed:  # resuming training reads the saved model through the same check
        check_same_model(read_checkpoint(path), small_model().cfg.to_dict(), path)
    assert_refused(str(resumed.value), path)
    assert not marker.exists() and PLANTED not in sys.modules


def test_a_module_the_model_does_not_need_is_not_imported_either(tmp_path, monkeypatch, caplog):
    """A checkpoint whose model builds without the modules it names (e.g. a plugin of metrics only) loads, with a
    note, and none is imported: not the planted one, not the standard library's `this` (which prints on import)."""
    monkeypatch.delenv("SINKLAB_PLUGINS", raising=False)
    code = tmp_path / "code"
    code.mkdir()
    marker = tmp_path / "imported.txt"
    (code / "planted_metrics_only.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\n")
    monkeypatch.syspath_prepend(str(code))
    model = small_model()
    path = save_ckpt(model, tmp_path / "m.ckpt")
    ckpt = torch.load(path, weights_only=True)
    ckpt[PLUGINS] = ["planted_metrics_only", "this"]
    torch.save(ckpt, path)
    assert "this" not in sys.modules
    with caplog.at_level("WARNING", logger="sinklab"):
        loaded = sinklab.load_model(path)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())
    assert not marker.exists() and "planted_metrics_only" not in sys.modules and "this" not in sys.modules
    assert "written with plugin module(s) planted_metrics_only, this, not loaded here" in caplog.text
    assert "SINKLAB_PLUGINS=planted_metrics_only,this loads them" in caplog.text


@pytest.mark.slow
@pytest.mark.ci  # in CI's ci tier: the default suite's time (issue 35)
def test_a_module_the_user_names_loads_the_checkpoint(planted):
    """The positive case, in a process of its own (the op registers there, not in this test process): the module
    named in SINKLAB_PLUGINS is imported, and the checkpoint loads with its op and knob and is measured."""
    code, marker, path = planted
    probe = textwrap.dedent(f"""
        import contextlib, io, json, sinklab
        from sinklab.cli import main
        op = sinklab.load_model({str(path)!r}).blocks[0].attn.op
        with contextlib.redirect_stdout(io.StringIO()) as measured:
            rc = main(["measure", {str(path)!r}, "--input", "random", "--num-seqs", "2", "--json"])
        print(type(op).__name__, op.alpha, rc, json.loads(measured.getvalue())["model"]["attn_op"])""")
    env = {**os.environ, "SINKLAB_PLUGINS": PLANTED, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["PlantedOp", "2.5", "0", "planted_op"], proc.stdout
    assert marker.read_text() == "imported"


@pytest.mark.parametrize("knob,default,owner", [
    ("window", 8, "the name of ModelConfig's own field model.window"),
    ("sigmoid_bias", 1.5, "but module sinklab.model.ops.sigmoid (model.attn_op=sigmoid) owns model.sigmoid_bias "
                          "with default 0.0"),
])
def test_a_plugin_knob_that_clashes_with_sinklab_is_one_line(knob, default, owner):
    """One UserError line, not a TypeError traceback from sinklab/model/config.py; the registry and ModelConfig stay
    as they were."""
    knobs = dataclasses.make_dataclass("Knobs", [(knob, type(default), dataclasses.field(default=default))])
    op = type("ClashingOp", (AttentionOp,), {"Knobs": knobs, "__module__": "mypkg.ops.clash",
                                             "normalise": lambda self, s, seen: torch.sigmoid(s) * seen})
    before = [f.name for f in dataclasses.fields(ModelConfig)]
    with pytest.raises(UserError) as refused:
        ATTENTION_OPS.register("clashing_op")(op)
    message = str(refused.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"module mypkg.ops.clash (model.attn_op=clashing_op) declares the knob {knob}")
    assert owner in message and "give the knob another name" in message, message
    assert "clashing_op" not in ATTENTION_OPS and [f.name for f in dataclasses.fields(ModelConfig)] == before
    assert ModelConfig().window is None and ModelConfig(attn_op="sigmoid").sigmoid_bias == 0.0
