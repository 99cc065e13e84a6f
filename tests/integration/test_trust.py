"""No file that sinklab reads chooses which code runs (docs/reliability.md, "Files from others").

A payload is planted in each kind of file sinklab reads (a run dir's saved config, overrides and group choices, its
status, a sweep dir's multirun.yaml, a checkpoint and a kept checkpoint, an exported model's config.json, tokenizer
and generation files, a .npy input), naming a module on the path (`sinklab_payload`, which writes a marker file when
it is imported or called) by each means a file could: a `_target_`, an `auto_map` entry, a plugin name, a pickle's
`__reduce__`, a Python file beside the model. Every command that reads the file runs on it, in one process whose path
holds the payload's module: no marker may appear, and each command either works (the planted key is not read as
code) or ends in one line.
"""
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers import FAST, train
from tests.helpers.cli import error_lines, run_cli, run_cli_in_one_process

PAYLOAD = "sinklab_payload"


class Planted:
    """What a pickle would import when it is loaded: the payload module (as a `__reduce__` can name any callable)."""

    def __reduce__(self):
        import importlib

        return importlib.import_module, (PAYLOAD,)


def payload_dir(base: Path) -> tuple[Path, Path]:
    """A dir for PYTHONPATH holding the payload module, and the marker it writes."""
    where, marker = base / "payload_path", base / "MARKER"
    where.mkdir()
    (where / f"{PAYLOAD}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n\n"
        "def boom(*args, **kwargs):\n    return None\n\nclass Boom:\n    pass\n")
    return where, marker


def edit_yaml(path: Path, edit) -> None:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))


def every_target(node, value: str) -> int:
    """Set every `_target_` of a nested dict to `value`; how many there were."""
    if isinstance(node, list):
        return sum(every_target(v, value) for v in node)
    if not isinstance(node, dict):
        return 0
    n = 0
    for key in list(node):
        if key == "_target_":
            node[key], n = value, n + 1
        else:
            n += every_target(node[key], value)
    return n


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small trained run with kept checkpoints (ALiBi, so its export is sinklab's remote code), its export, and the
    payload module's dir."""
    base = tmp_path_factory.mktemp("trust")
    run = train(base / "run", "trainer.max_steps=4", "model.pos=alibi", "callbacks.checkpoint.keep.every_n_steps=2",
                "data.val_num_blocks=4", "data.probe_num_seqs=4", recipe=FAST).dir
    run_cli("sinklab", "export-hf", str(run), str(base / "hf"), check=True)
    return base, run, base / "hf"


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("wandb", "*.html", "*.png"))
    return dst


def run_commands(run: Path, out: Path) -> list[list[str]]:
    """Every command that reads a run dir (and its checkpoints), as a user types them."""
    return [["measure", str(run), "--input", "natural"], ["measure", str(run / "checkpoints" / "last.ckpt")],
            ["atlas", str(run), "--out", str(out / "atlas.html")], ["export-hf", str(run), str(out / "hf")],
            ["eval", "streaming", str(run), "--first", "0,4", "--recent", "12", "--n-tokens", "256",
             "--baselines", "none"],
            ["eval", "intervene", str(run)], ["quant", str(run), "--schemes", "w8a8"],
            ["sample", str(run), "--prompt", "the", "--max-new-tokens", "2"],
            ["trajectory", str(run), "--csv", str(out / "t.csv"), "--plot", str(out / "t.png")]]


def model_commands(hf: Path, data: Path, out: Path) -> list[list[str]]:
    """Every command that reads an exported model dir."""
    return [["measure", "--hf-model", str(hf), "--input", "random"], ["measure", "--hf-model", str(hf)],
            ["atlas", "--hf-model", str(hf), "--input", "random", "--out", str(out / "hf_atlas.html")],
            ["eval", "streaming", "--hf-model", str(hf), "--data", str(data), "--first", "4", "--recent", "12",
             "--n-tokens", "256", "--baselines", "none"],
            ["quant", "--hf-model", str(hf), "--data", str(data), "--schemes", "w8a8"]]


def plant(kind: str, trained, base: Path) -> tuple[list[list[str]], bool]:
    """A copy of the run (or export) with the payload planted in one kind of file; the commands that read it and
    whether every one of them must refuse (one line, exit 2) rather than possibly work."""
    _, run0, hf0 = trained
    run = copy_run(run0, base / "run")
    config = run / ".hydra" / "config.yaml"
    if kind == "run config: data._target_":
        edit_yaml(config, lambda c: c["data"].update(_target_=f"{PAYLOAD}.boom"))
        return run_commands(run, base), True
    if kind == "run config: every other _target_":
        def others(c):
            data = c.pop("data")
            assert every_target(c, f"{PAYLOAD}.boom") >= 3
            c["data"] = data
        edit_yaml(config, others)
        return run_commands(run, base), False
    if kind == "overrides and group choices":
        sweep = base / "sweep"
        sweep.mkdir()
        job = copy_run(run, sweep / "0")
        shutil.rmtree(run)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+x._target_={PAYLOAD}.boom",
                                                                        f"data._target_={PAYLOAD}.boom"]))
        edit_yaml(job / ".hydra" / "hydra.yaml",
                  lambda h: h["hydra"]["runtime"]["choices"].update({"model/attn": f"{PAYLOAD}.boom"}))
        return [["report", str(sweep), "--out", str(base / "report")],
                ["eval", "intervene", "--sweep", str(sweep)]], False
    if kind == "status.json and multirun.yaml":
        sweep = base / "sweep"
        sweep.mkdir()
        copy_run(run, sweep / "0")
        shutil.rmtree(run)
        (sweep / "0" / "status.json").write_text(json.dumps({"status": "finished", "_target_": f"{PAYLOAD}.boom"}))
        (sweep / "multirun.yaml").write_text(yaml.safe_dump(
            {"hydra": {"sweeper": {"_target_": f"{PAYLOAD}.Boom", "params": None},
                       "launcher": {"_target_": f"{PAYLOAD}.Boom"},
                       "overrides": {"task": [f"data._target_={PAYLOAD}.boom"]}},
             "data": {"_target_": f"{PAYLOAD}.boom"}}))
        return [["report", str(sweep), "--out", str(base / "report")],
                ["eval", "intervene", "--sweep", str(sweep)]], False
    if kind == "checkpoint: pickle":
        torch.save({"state_dict": {}, "planted": Planted(), "global_step": 1}, run / "checkpoints" / "last.ckpt")
        return run_commands(run, base), True
    if kind == "kept checkpoint: pickle":
        kept = sorted((run / "checkpoints" / "kept").glob("*.ckpt"))
        assert kept, "the run keeps checkpoints"
        torch.save({"state_dict": {}, "planted": Planted()}, kept[0])
        return [["atlas", str(run), "--out", str(base / "a.html")],
                ["trajectory", str(run), "--csv", str(base / "t.csv"), "--plot", str(base / "t.png")]], True
    if kind == "npy input: pickle":
        arr = np.empty(2, dtype=object)
        arr[:] = [Planted(), Planted()]
        np.save(base / "tokens.npy", arr, allow_pickle=True)
        return [["measure", str(run), "--tokens", str(base / "tokens.npy")],
                ["quant", str(run), "--tokens", str(base / "tokens.npy")]], True
    hf = copy_run(hf0, base / "hf")
    cfg_path = hf / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if kind == "export: auto_map names another module":
        (hf / "evil.py").write_text(f"import {PAYLOAD}\nfrom transformers import PretrainedConfig\n"
                                    "class Evil(PretrainedConfig):\n    model_type = 'sinklab'\n")
        cfg["auto_map"]["AutoConfig"] = "evil.Evil"
    elif kind == "export: a third Python file":
        (hf / "helper.py").write_text(f"import {PAYLOAD}\n")  # sinklab's two files and auto_map stay as written
    elif kind == "export: sinklab_plugins":
        cfg["sinklab_plugins"] = {PAYLOAD: None}
    elif kind == "export: tokenizer_config.json auto_map":
        tok_cfg = json.loads((hf / "tokenizer_config.json").read_text())
        tok_cfg["auto_map"] = {"AutoTokenizer": [f"{PAYLOAD}.Boom", None]}
        (hf / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    elif kind == "export: generation_config.json":
        (hf / "generation_config.json").write_text(json.dumps({"_target_": f"{PAYLOAD}.boom",
                                                               "custom_generate": PAYLOAD}))
    else:
        raise AssertionError(kind)
    cfg_path.write_text(json.dumps(cfg))
    return model_commands(hf, run, base), kind != "export: generation_config.json"


def warm_starts(kind: str, base: Path) -> list[Path]:
    """What `sinklab-train init_from=` reads of a planted copy: a run's checkpoint, a sweep's jobs."""
    if kind in ("checkpoint: pickle", "run config: every other _target_"):
        return [base / "run"]
    if kind in ("overrides and group choices", "status.json and multirun.yaml"):
        return [base / "sweep"]
    return []


KINDS = ["run config: data._target_", "run config: every other _target_", "overrides and group choices",
         "status.json and multirun.yaml", "checkpoint: pickle", "kept checkpoint: pickle", "npy input: pickle",
         "export: auto_map names another module", "export: a third Python file", "export: sinklab_plugins",
         "export: tokenizer_config.json auto_map", "export: generation_config.json"]


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "".join(c if c.isalnum() else "_" for c in k).strip("_"))
def test_no_file_chooses_the_code_that_runs(trained, kind, tmp_path):
    where, marker = payload_dir(tmp_path)
    commands, refuse = plant(kind, trained, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")])),
           "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}  # transformers' copies of remote code: this test's
    ran = run_cli_in_one_process("sinklab", commands, env=env, warnings="ignore")
    trainings = [[f"paths.output_dir={tmp_path / 'warm'}", f"init_from={src}", "trainer.max_steps=1", *FAST]
                 for src in warm_starts(kind, tmp_path)]
    ran += run_cli_in_one_process("sinklab-train", trainings, env=env, warnings="ignore") if trainings else []
    assert not marker.exists(), f"{kind}: the payload ran ({marker.read_text()})"
    for args, (code, out, err) in zip(commands + trainings, ran):
        lines = error_lines(err)
        shown = f"sinklab {' '.join(args)} -> exit {code}\n{out[-1500:]}\n{err[-3000:]}"
        if refuse or code != 0:
            assert code == 2 and len(lines) == 1 and "Traceback" not in err, shown
        if refuse:
            assert "error" in lines[0], shown


def test_the_payload_would_run_if_a_command_imported_it(tmp_path):
    """The test's own check: the payload module writes its marker when imported, and the planted pickle imports it
    when unpickled without weights_only (so the checks above can fail)."""
    import subprocess
    import sys

    where, marker = payload_dir(tmp_path)
    blob = tmp_path / "p.pkl"
    blob.write_bytes(pickle.dumps(Planted()))
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads(open({str(blob)!r}, 'rb').read())"],
                   env={"PYTHONPATH": str(where)}, check=True)
    assert marker.read_text() == "imported"
