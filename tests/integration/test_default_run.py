"""A run made as the README makes it: `sinklab-train` in a working dir with no paths.output_dir, so that the run dir
comes from Hydra's `${now:...}` and the saved config keeps that interpolation, which nothing outside Hydra resolves.
Every reader of a saved run config reads it (`sinklab.runs.run_data.load_run_config`): the export writes the run's
tokenizer, measure, quant, streaming and report read the run. Its bits per byte (training's val/bpb, quant, streaming,
the report) equal the brute-force total NLL / ln 2 / bytes of the decoded targets; a tokenizer that does not decode
to UTF-8 is refused before training."""
from __future__ import annotations

import csv
import json
import math
import random
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from sinklab.keys import VAL_BPB, VAL_LOSS
from sinklab.runs.run_data import RUN_CONFIG, load_run_config
from tests.helpers import FAST, VERSE, assert_one_line_error, rows, run_cli, small

# FAST with 3 of the 4 validation batches (64 blocks of 16): bits per byte must count the validated blocks' bytes
RECIPE = [o if not o.startswith("trainer.limit_val_batches=") else "trainer.limit_val_batches=3" for o in FAST]
STEPS = 20


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """`sinklab-train` with FAST's overrides and no paths.output_dir, in a fresh working dir (SINKLAB_ROOT unset, as
    a new user's shell): the run dir is ./logs/train/runs/<time>."""
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.delenv("SINKLAB_ROOT", raising=False)
        run_cli("sinklab-train", *RECIPE, f"trainer.max_steps={STEPS}", warnings="ignore", check=True)
    runs = list((cwd / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


@pytest.fixture
def outside_hydra():
    """This process as a command's own is, with no Hydra app in it: without Hydra's `now` resolver, which every Hydra
    instance (a sinklab-train in this process, a composition) registers for the whole process."""
    from hydra.core.utils import setup_globals

    OmegaConf.clear_resolver("now")
    try:
        yield
    finally:
        setup_globals()  # as the next Hydra instance would


def data_module(run: Path):
    from hydra.utils import instantiate

    dm = instantiate(load_run_config(run).data, _recursive_=False)
    return dm.prepare()


def final(run: Path, key: str) -> float:
    return float([r for r in rows(run / "metrics.csv") if r.get(key)][-1][key])


def decoded_bytes(tok, ids: list[int]) -> int:
    return len(tok.decode(ids).encode("utf-8"))


# ------------------------------------------------------------------------------------------------ the run config
def test_the_saved_config_keeps_hydras_now_and_resolves_through_load_run_config(default_run, outside_hydra):
    saved = OmegaConf.load(default_run / RUN_CONFIG)
    assert "${now:" in OmegaConf.to_yaml(saved)  # the run meets the blind spot
    with pytest.raises(Exception, match="Unsupported interpolation type now"):
        OmegaConf.to_container(saved, resolve=True)
    cfg = OmegaConf.to_container(load_run_config(default_run), resolve=True)
    assert cfg["paths"]["output_dir"] == str(default_run)
    assert cfg["callbacks"]["checkpoint"]["dirpath"] == f"{default_run}/checkpoints"


def test_the_export_writes_the_runs_tokenizer_and_it_round_trips_the_probe_text_bos_included(default_run, tmp_path,
                                                                                          capsys, outside_hydra):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    printed = run_cli("sinklab", "export-hf", str(default_run), str(out), capsys=capsys, check=True).stdout
    assert "tokenizer: from the run's data module" in printed and "skipped" not in printed
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    dm = data_module(default_run)
    probe = dm.probe_tokens().tolist()
    bos = dm.eos_id  # data.bos: the BOS token is the document separator, <|endoftext|>
    assert all(seq[0] == bos for seq in probe)
    text = tok.decode(probe[0])
    assert text.startswith("<|endoftext|>") and tok(text)["input_ids"] == probe[0]
    for seq in probe:  # every probe sequence's text: the export encodes it as the run's tokenizer does
        assert tok(tok.decode(seq))["input_ids"] == dm.tokenizer.encode(tok.decode(seq)).ids


def test_measure_reads_the_runs_probe_set(default_run, capsys, outside_hydra):
    res = json.loads(run_cli("sinklab", "measure", str(default_run), "--num-seqs", "8", "--json", capsys=capsys,
                             check=True).stdout)
    assert res["input"] == "natural" and res["num_seqs"] == 8 and 0 <= res["sink"]["1"] <= 100


# ------------------------------------------------------------------------------------------------ bits per byte
def test_val_bpb_is_the_total_nll_over_ln2_and_the_bytes_of_the_validated_targets(default_run):
    """The final validation (after the last step, on last.ckpt's weights) by brute force: the summed NLL of the
    targets of its 3 batches, in bits, over the UTF-8 bytes their text decodes to (each block's first token, the BOS,
    is an input, not a target)."""
    import sinklab

    dm = data_module(default_run)
    model = sinklab.load_model(default_run)
    nll, targets, n_bytes, all_bytes = 0.0, 0, 0, 0
    batches = list(dm.val_dataloader())
    assert len(batches) == 4  # 64 blocks of 16: validation scores 3 of them
    for i, batch in enumerate(batches):
        for block in batch:
            all_bytes += decoded_bytes(dm.tokenizer, block[1:].tolist())
        if i < 3:
            with torch.no_grad():
                nll += F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(),
                                       reduction="sum").item()
            targets += batch[:, 1:].numel()
            n_bytes += sum(decoded_bytes(dm.tokenizer, block[1:].tolist()) for block in batch)
    assert final(default_run, VAL_LOSS) == pytest.approx(nll / targets, rel=1e-5)
    bpb = final(default_run, VAL_BPB)
    assert bpb == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-5)
    assert bpb != pytest.approx(nll / math.log(2) / (all_bytes * targets / (64 * 64)), rel=1e-5)  # not all blocks'
    assert 1.5 < n_bytes / targets < 4  # a 1024-token BPE on English text
    status = json.loads((default_run / "status.json").read_text())
    assert status["final"][VAL_BPB] == pytest.approx(bpb)


def test_quant_reports_bits_per_byte_of_its_validation_batches(default_run, capsys, outside_hydra):
    res = json.loads(run_cli("sinklab", "quant", str(default_run), "--schemes", "w8a8", "--val-batches", "2",
                             "--calib-batches", "1", "--json", capsys=capsys, check=True).stdout)
    dm = data_module(default_run)
    blocks = [b for batch in islice(dm.val_dataloader(), 2) for b in batch]
    n_bytes = sum(decoded_bytes(dm.tokenizer, b[1:].tolist()) for b in blocks)
    assert res["val_targets"] == 2 * 16 * 64
    for scheme in ("fp32", "w8a8"):
        r = res["schemes"][scheme]
        assert r["bpb"] == pytest.approx(r["loss"] * res["val_targets"] / math.log(2) / n_bytes, rel=1e-12)
    text = run_cli("sinklab", "quant", str(default_run), "--schemes", "w8a8", "--val-batches", "2",
                   "--calib-batches", "1", capsys=capsys, check=True).stdout
    assert " bpb " in text and f"{res['schemes']['fp32']['bpb']:.4f}" in text


def test_streaming_reports_bits_per_byte_of_its_text(default_run, capsys, outside_hydra):
    res = json.loads(run_cli("sinklab", "eval", "streaming", str(default_run), "--first", "4", "--recent", "16",
                             "--n-tokens", "300", "--baselines", "none", "--json", capsys=capsys, check=True).stdout)
    dm = data_module(default_run)
    text = dm.val_text(300)
    n_bytes = decoded_bytes(dm.tokenizer, text[1:].tolist())  # the 299 targets; the BOS first is an input
    (setting,) = res["settings"]
    assert setting["bpb"] == pytest.approx(setting["loss"] * 299 / math.log(2) / n_bytes, rel=1e-12)


def test_the_report_shows_val_bpb_beside_val_loss(default_run, tmp_path, capsys, outside_hydra):
    out = tmp_path / "report"
    run_cli("sinklab", "report", str(default_run), "--out", str(out), capsys=capsys, check=True)
    with open(out / "report.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["val_bpb"]) == pytest.approx(final(default_run, VAL_BPB))
    header = next(line for line in (out / "report.md").read_text().splitlines() if "val loss (nats)" in line)
    assert "val bits per byte" in header
    assert f"{final(default_run, VAL_BPB):.3f}" in (out / "report.md").read_text()


def test_a_tokenizer_that_does_not_decode_to_utf8_is_refused_before_training(tmp_path):
    """A word-level tokenizer with a ByteLevel decoder: 'é' stands for byte 0xE9 there, which the text after it does
    not continue. One line naming the tokenizer file; no checkpoint, no metrics."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    files = []
    for d in range(6):
        path = tmp_path / f"doc{d}.txt"
        path.write_text("\n".join(" ".join(rng.choice([*VERSE, "café", "naïve"]) for _ in range(12))
                                  for _ in range(150)) + "\n", encoding="utf-8")
        files.append(path)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([p.read_text() for p in files],
                            trainers.WordLevelTrainer(special_tokens=["<|endoftext|>", "[UNK]"]))
    tok.decoder = decoders.ByteLevel()
    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    tok.save(str(tok_file))
    corpus = type("Corpus", (), {"files": [str(p) for p in files], "cache": str(tmp_path / "cache")})
    run = tmp_path / "run"
    ran = run_cli("sinklab-train", f"paths.output_dir={run}", *small(corpus, f"data.tokenizer={tok_file}"),
                  warnings="ignore")
    assert ran.returncode == 2
    assert_one_line_error(ran.stderr, "bits per byte", str(tok_file), "the validation blocks", "invalid UTF-8",
                          starts="error: ", logs=True)
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()
