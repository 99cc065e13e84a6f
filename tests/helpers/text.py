"""Deterministic text for the corpora of the data and training tests."""
import random

WORDS = ["".join(random.Random(i).choice("etaoinshrdlucmfwypvbgk") for _ in range(1 + i % 8)) for i in range(300)]

VERSE = ("thou art the king of nothing more than the shadow of a dream that waking sees no morning light "
         "and every word we speak returns as echo to the silent hall where once the music played").split()


def fake_text(seed: int, n_words: int) -> str:
    """Deterministic pseudo-prose with a Zipf-like word distribution (corpora for the data tests)."""
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        line.append(WORDS[min(int(rng.paretovariate(1.0)) - 1, len(WORDS) - 1)] if rng.random() < 0.7
                    else rng.choice(WORDS))
        if rng.random() < 0.12:
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    return "\n".join(lines) + "\n"


def bpe_corpus(root, n_docs: int, first_seed: int, vocab: int, name: str = "doc{i}.txt"):
    """A local corpus for the data tests: `n_docs` files of fake_text (seeds first_seed + i, 1,500 words each, named
    by `name`) and a BPE tokenizer of `vocab` trained on them. Returns (root, files, tok, cache) as a namespace."""
    from pathlib import Path
    from types import SimpleNamespace

    from sinklab.data.tokenizer import train_bpe

    root = Path(root)
    files = []
    for i in range(n_docs):
        path = root / name.format(i=i)
        path.write_text(fake_text(first_seed + i, 1500), encoding="utf-8")
        files.append(str(path))
    tok = train_bpe([Path(f).read_text(encoding="utf-8") for f in files], vocab)
    tok.save(str(root / "tok.json"))
    return SimpleNamespace(root=root, files=files, tok=str(root / "tok.json"), cache=str(root / "cache"))


def corpus_dm(env, **settings):
    """The prepared LMDataModule of a bpe_corpus `env`: blocks of 32, batches of 8, 8 validation blocks, a probe set of
    10 x 16, seed 0; `settings` change or add data.* keys."""
    from sinklab.data import LMDataModule

    args = dict(corpus="local", files=env.files, tokenizer=env.tok, cache_dir=env.cache, block_size=32,
                batch_size=8, val_num_blocks=8, probe_num_seqs=10, probe_seq_len=16, seed=0)
    return LMDataModule(**{**args, **settings}).prepare()
