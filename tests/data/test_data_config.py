"""The typed data config (sinklab/data/config.py): DataConfig and SyntheticDataConfig in Hydra's ConfigStore.

A wrong type, an unknown key and a broken cross-field rule are each refused with one line naming the data.<key>,
whether they come from the command line or from a preset yaml file, before any data is read; the presets in
conf/data hold only what differs from their schema, and `sinklab prepare --config` reads them the same way.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sinklab.config import compose, validate_config
from sinklab.data import LMDataModule
from sinklab.data.config import SCHEMAS, DataConfig, SyntheticDataConfig, load_preset
from sinklab.cli.prepare import parse_args
from sinklab.data.synthetic import SyntheticDataModule
from sinklab.errors import UserError
from tests.helpers import REPO, assert_one_line_error, run_cli

CONF_DATA = REPO / "conf" / "data"
PRESETS = sorted(p.stem for p in CONF_DATA.glob("*.yaml"))
ALLOWED_KEYS = ", ".join(sorted(f.name for f in fields(DataConfig) if not f.name.startswith("_")))


def write_preset(root: Path, name: str, body: str) -> Path:
    (root / "data").mkdir(parents=True, exist_ok=True)
    path = root / "data" / f"{name}.yaml"
    path.write_text(body)
    return path


BAD_OVERRIDES = [
    # wrong types: refused by OmegaConf while composing, in the words of the field's rule
    (["data.batch_size=abc"], "data.batch_size='abc' is not allowed; allowed: an integer >= 1"),
    (["data.val_fraction=half"], "data.val_fraction='half' is not allowed; allowed: a number > 0 and <= 0.5"),
    (["data.bos=maybe"], "data.bos='maybe' is not allowed; allowed: true or false"),
    (["data.streaming=maybe"], "data.streaming='maybe' is not allowed; allowed: true or false or null"),
    (["data.fixed_token.position=two"], "data.fixed_token.position='two' is not allowed; allowed: an integer >= 1 "
                                        "or null"),
    (["data.files=a.txt"], "data.files='a.txt' is not allowed; allowed: a list of .txt/.jsonl/.parquet files, e.g. "
                           "data.files=[a.txt,b.jsonl]"),
    (["data=synthetic", "data.n_tokens=many"], "data.n_tokens='many' is not allowed; allowed: an integer >= 2"),
    # unknown keys, with or without +
    (["data.bogus=1"], f"data.bogus is not an option of data (did you mean data.bos?); allowed: {ALLOWED_KEYS}"),
    (["+data.bogus=1"], f"data.bogus is not an option of data (did you mean data.bos?); allowed: {ALLOWED_KEYS}"),
    (["data.fixed_token.pos=2"], "data.fixed_token.pos is not an option of data.fixed_token; allowed: position, "
                                 "token_id"),
    (["data=synthetic", "data.corpus=local"], "data.corpus is not an option of data"),
    # single-field and cross-field rules (__post_init__)
    (["data.corpus=shakspeare"], "data.corpus='shakspeare' is not allowed; allowed: one of shakespeare, local, hub"),
    (["data.val_fraction=0.9"], "data.val_fraction=0.9 is not allowed; allowed: a number > 0 and <= 0.5"),
    (["data.num_workers=-1"], "data.num_workers=-1 is not allowed; allowed: an integer >= 0"),
    (["data.vocab_size=100"], "data.vocab_size=100 is not allowed; allowed: an integer >= 258 (data.tokenizer=bpe "
                             "trains a BPE of that size)"),
    (["data.corpus=hub"], "data.corpus=hub needs data.hub_path"),
    (["data.bos=true", "data.random_positions=[1]"], "data.bos=true puts BOS at position 1, which "
                                                     "data.random_positions also resamples"),
    (["data.random_positions=[2,2]"], "data.random_positions=[2, 2] repeats a position"),
    (["data.fixed_token.position=65"], "data.fixed_token.position=65 is outside 1..block_size=64"),
    (["data.fixed_token.token_id=5"], "data.fixed_token.token_id is set but data.fixed_token.position is null"),
    (["data.probe_fixed_token=true"], "data.probe_fixed_token=true needs data.fixed_token.position in "
                                      "1..data.probe_seq_len=64; got data.fixed_token.position=null"),
    (["data=synthetic", "data.n_triggers=64"], "data.n_triggers=64 must be below data.n_tokens=64"),
    # data.retrieval (sinklab/data/retrieval/): the default block is 64 tokens + 1, with a BOS
    (["data.retrieval.task=copy"], "data.retrieval.task='copy' is not allowed; allowed: null or one of passkey, mqar"),
    (["data.retrieval.task=mqar", "data.retrieval.rate=2"], "data.retrieval.rate=2.0 is not allowed; allowed: a number "
                                                            ">= 0 and <= 1"),
    (["data.retrieval.rate=0.5"], "data.retrieval.rate=0.5 needs data.retrieval.task: one of passkey, mqar"),
    (["data.retrieval.task=passkey", "data.retrieval.key_len=32"],
     "data.retrieval.key_len=32 is not allowed; allowed: an integer <= 31 (a passkey sample is BOS + 2 markers + the "
     "key twice = 67 tokens, more than a block's 65: block_size + 1)"),
    (["data.retrieval.task=mqar", "data.retrieval.n_pairs=17"],
     "data.retrieval.n_pairs=17 is not allowed; allowed: an integer <= 16 (mqar needs 4 x n_pairs tokens"),
    (["data.retrieval.key=4"], "data.retrieval.key is not an option of data.retrieval"),
]


@pytest.mark.parametrize("overrides,expected", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_data_override_is_one_line_naming_the_key(overrides, expected, tmp_path, capsys):
    rc, out, err = run_cli("sinklab-train", f"paths.output_dir={tmp_path}", *overrides, capsys=capsys)
    assert rc == 2 and "Traceback" not in out, (out, err)
    assert_one_line_error(err, starts="error: " + expected, logs=True)
    assert not (tmp_path / "metrics.csv").exists()  # refused before anything ran


PRESET_ERRORS = [
    ("batch_size: abc", "conf/data/mine.yaml: data.batch_size='abc' is not allowed; allowed: an integer >= 1"),
    ("bogus: 1", f"conf/data/mine.yaml: data.bogus is not an option of data (did you mean data.bos?); allowed: "
                 f"{ALLOWED_KEYS}"),
    ("fixed_token:\n  pos: 2", "conf/data/mine.yaml: data.fixed_token.pos is not an option of data.fixed_token; "
                               "allowed: position, token_id"),
    ("val_fraction: 0.7", "data.val_fraction=0.7 is not allowed; allowed: a number > 0 and <= 0.5"),
    ("bos: true\nfixed_token:\n  position: 1", "data.bos=true puts BOS at position 1, where data.fixed_token also "
                                               "goes"),
]


@pytest.mark.parametrize("body,expected", PRESET_ERRORS, ids=[b.split(":")[0] for b, _ in PRESET_ERRORS])
def test_bad_preset_file_is_one_line_naming_the_key(body, expected, tmp_path, capsys):
    """A user's own preset (data=mine from a config dir on Hydra's search path), written like conf/data/*.yaml."""
    write_preset(tmp_path / "conf", "mine", f"defaults:\n  - lm_schema\n  - _self_\nblock_size: 32\n{body}\n")
    args = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=mine", f"paths.output_dir={tmp_path / 'run'}"]
    rc, out, err = run_cli("sinklab-train", *args, capsys=capsys)
    assert rc == 2 and "Traceback" not in out, (out, err)
    assert assert_one_line_error(err, logs=True) == "error: " + expected


def test_direct_construction_checks_the_same_rules():
    with pytest.raises(UserError, match=r"^data has unknown key\(s\) \['bogus'\]; allowed: archive, batch_size, "):
        LMDataModule(bogus=1)
    with pytest.raises(UserError, match=r"^data.fixed_token has unknown key\(s\) \['pos'\]; allowed: position, "
                                        r"token_id$"):
        LMDataModule(fixed_token={"pos": 1})
    with pytest.raises(UserError, match=r"^data.task='copy' is not allowed; allowed: one of seen_flag, "
                                        r"bigram_backcopy$"):
        SyntheticDataModule(task="copy")
    with pytest.raises(UserError, match=r"^data.probe_seq_len=1 is not allowed; allowed: an integer >= 2$"):
        SyntheticDataModule(probe_seq_len=1)
    dm = LMDataModule(corpus="local", files="a.txt", fixed_token={"position": 2})  # files are read by prepare()
    assert dm.config.files == ["a.txt"] and dm.config.fixed_position == 2 and dm.hparams.fixed_token == {
        "position": 2, "token_id": None}


def test_presets_hold_only_what_differs_from_their_schema():
    """Defaults exist once: in the dataclass. A preset sets a key only to change it (or to interpolate it)."""
    assert PRESETS == ["default", "fineweb_edu", "local", "pile", "shakespeare", "synthetic"]
    for name in PRESETS:
        raw = OmegaConf.load(CONF_DATA / f"{name}.yaml")
        schemas = [entry for entry in raw.defaults if entry in SCHEMAS]
        assert raw.defaults[-1] == "_self_" and (schemas == [raw.defaults[0]] or name == "default"), name
        if schemas:
            defaults = OmegaConf.structured(SCHEMAS[schemas[0]])
            for key in raw:
                if key != "defaults" and not OmegaConf.is_interpolation(raw, key):
                    assert raw[key] != defaults[key], f"conf/data/{name}.yaml repeats the default {key}={raw[key]}"


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_composes_to_its_schema_and_validates(name):
    cfg = compose([f"data={name}", "~scale"])  # the preset alone (the default scale sets data.batch_size)
    # `sinklab prepare --config` reads a preset as Hydra composes it
    assert OmegaConf.to_container(load_preset(CONF_DATA / f"{name}.yaml")) == OmegaConf.to_container(cfg.data)
    if name == "local":
        cfg = compose([f"data={name}", "data.files=[a.txt]"])  # read by prepare(), not before
    validate_config(cfg)
    data = OmegaConf.to_object(cfg.data)
    assert isinstance(data, SyntheticDataConfig if name == "synthetic" else DataConfig)
    assert data.block_size == cfg.model.block_size and data.seed == cfg.seed


def test_prepare_reads_a_preset_and_flags_win(tmp_path):
    _, config = parse_args(["--config", str(CONF_DATA / "fineweb_edu.yaml"), "--files", "x.parquet", "--num-proc",
                            "2", "--out", str(tmp_path)], "sinklab prepare")
    assert (config.corpus, config.hub_name, config.group_field, config.val_fraction) == \
        ("hub", "sample-10BT", "id", 0.0005)
    assert (config.files, config.num_proc, config.docs_per_shard) == (["x.parquet"], 2, 100_000)
    with pytest.raises(UserError, match=r"^data.docs_per_shard=0 is not allowed; allowed: an integer >= 1$"):
        parse_args(["--docs-per-shard", "0", "--out", str(tmp_path)], "sinklab prepare")
    bad = write_preset(tmp_path, "bad", "defaults:\n  - lm_schema\n  - _self_\nnum_prc: 2\n")
    with pytest.raises(UserError, match=r"bad.yaml: Key 'num_prc' not in 'DataConfig'"):
        parse_args(["--config", str(bad), "--out", str(tmp_path)], "sinklab prepare")
