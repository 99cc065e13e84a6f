"""Issue-5 controls on training blocks: unique-token cap, random positions, fixed token, BOS.

They must change training blocks exactly as specified and leave validation blocks and the probe set alone.
"""

import logging

import lightning as L
import numpy as np
import pytest
import torch

from sinklab.data import LMDataModule
from sinklab.errors import UserError
from tests.helpers import bpe_corpus, corpus_dm


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return bpe_corpus(tmp_path_factory.mktemp("controls"), 10, 1000, 300)


make_dm = corpus_dm


def natural(dm, i, length=33):
    """The corpus tokens sample i is read from."""
    return dm._stores["train"].read(dm.train_blocks.offset(i), length)


def chi_square_uniform(values: np.ndarray, k: int) -> float:
    counts = np.bincount(values, minlength=k)
    expected = len(values) / k
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------- unique-token cap


def test_unique_token_cap_bounds_what_training_reads(env):
    N = 3000
    dm = make_dm(env, max_unique_tokens=N)
    blocks = dm.train_blocks
    offsets = np.array([blocks.offset(i) for i in range(4000)])
    assert offsets.max() < N - 32 and offsets.min() >= 0
    assert len(np.unique(offsets)) > 0.6 * (N - 32)  # the whole capped range is used, and repeated
    head = dm._stores["train"].read(0, N)
    for i in range(0, 4000, 97):
        assert torch.equal(blocks[i], torch.from_numpy(head[offsets[i]:offsets[i] + 33]))
    uncapped = make_dm(env).train_blocks
    assert max(uncapped.offset(i) for i in range(4000)) > 5 * N  # without the cap blocks come from everywhere
    # batch size and steps are unchanged: the cap only restricts where blocks are read
    assert next(iter(dm.make_train_loader(step=5))).shape == (8, 33)


def test_epochs_over_unique_data_is_reported(env, caplog):
    dm = make_dm(env, max_unique_tokens=4096)
    assert dm.epochs_over_unique(max_steps=100, global_batch=8) == pytest.approx(100 * 8 * 32 / 4096)
    assert dm.describe()["unique_tokens"] == 4096
    trainer = L.Trainer(max_steps=100, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    dm.trainer = trainer
    with caplog.at_level(logging.INFO):
        dm.train_dataloader()
    line = next(r.getMessage() for r in caplog.records if "epochs over" in r.getMessage())
    assert "100 steps x 8 blocks x 32 tokens = 25,600 tokens = 6.25 epochs over 4,096 unique" in line
    assert dm.describe()["epochs_over_unique"] == 6.25
    dm.trainer = None


def test_unique_token_cap_larger_than_the_data_is_an_error(env):
    with pytest.raises(UserError, match="max_unique_tokens=100000000 exceeds the"):
        make_dm(env, max_unique_tokens=100_000_000)
    with pytest.raises(UserError, match="max_unique_tokens has 20 tokens, fewer than one block"):
        make_dm(env, max_unique_tokens=20)


# ---------------------------------------------------------------------------------------------- random positions


@pytest.mark.parametrize("positions", [[1], [1, 2], [2]])
def test_random_positions_are_uniform_and_the_rest_is_untouched(env, positions):
    dm = make_dm(env, random_positions=positions)
    V = dm.tokenizer.get_vocab_size()
    n = 6000
    blocks = torch.stack([dm.train_blocks[i] for i in range(n)]).numpy()  # (n, 33)
    nat = np.stack([natural(dm, i) for i in range(n)])
    limit = (V - 1) + 6 * np.sqrt(2 * (V - 1))  # chi-square with V-1 dof: mean V-1, sd sqrt(2(V-1))
    for p in positions:
        assert blocks[:, p - 1].max() < V
        assert chi_square_uniform(blocks[:, p - 1], V) < limit
    for p in {1, 2, 3} - set(positions):  # the same statistic flags natural text, so the check has power
        assert chi_square_uniform(blocks[:, p - 1], V) > 3 * limit
    keep = [c for c in range(33) if c + 1 not in positions]
    assert np.array_equal(blocks[:, keep], nat[:, keep])
    assert (blocks[:, positions[0] - 1] != nat[:, positions[0] - 1]).mean() > 0.9
    again = make_dm(env, random_positions=positions).train_blocks  # resampled tokens are deterministic too
    assert all(torch.equal(again[i], dm.train_blocks[i]) for i in (0, 17, 5000))


# ---------------------------------------------------------------------------------------------- fixed token, BOS


def test_fixed_new_token_at_position(env):
    dm = make_dm(env, fixed_token={"position": 2, "token_id": None})
    V = dm.tokenizer.get_vocab_size()
    assert dm.vocab_size == 320 and dm.describe()["fixed_token"] == {"position": 2, "token_id": V}
    batch = next(iter(dm.make_train_loader()))
    assert (batch[:, 1] == V).all() and (batch[:, [0] + list(range(2, 33))] < V).all()
    for j in range(8):
        expect = torch.from_numpy(natural(dm, j))
        expect[1] = V
        assert torch.equal(batch[j], expect)


def test_fixed_token_position_override_composes_and_applies(env):
    """The documented override `data.fixed_token.position=2` (no `+`): it composes on every data config that has
    the control, is off while the position is null, and puts the dedicated token at position 2 of every block."""
    from hydra.errors import ConfigCompositionException
    from hydra.utils import instantiate

    from sinklab.config import compose, hydra_error_message, validate_config

    files = "[" + ",".join(f"'{f}'" for f in env.files) + "]"
    common = ["data=local", f"data.files={files}", f"data.tokenizer='{env.tok}'", f"data.cache_dir='{env.cache}'",
              "model.block_size=32", "data.batch_size=8", "data.val_num_blocks=8", "data.probe_num_seqs=10",
              "data.probe_seq_len=16"]
    for data in ("default", "shakespeare", "local", "fineweb_edu", "pile"):
        cfg = compose([f"data={data}", "data.fixed_token.position=2"])
        assert cfg.data.fixed_token.position == 2 and cfg.data.fixed_token.token_id is None, data
    cfg = compose([*common, "data.fixed_token.position=2"])
    validate_config(cfg)
    dm = instantiate(cfg.data, _recursive_=False).prepare()
    V = dm.tokenizer.get_vocab_size()
    assert dm.describe()["fixed_token"] == {"position": 2, "token_id": V}
    blocks = torch.stack([dm.train_blocks[i] for i in range(500)])
    assert (blocks[:, 1] == V).all() and (blocks[:, [0] + list(range(2, 33))] < V).all()
    batch = next(iter(dm.make_train_loader(step=3)))
    assert (batch[:, 1] == V).all()
    off = instantiate(compose(common).data, _recursive_=False).prepare()  # the default: position null, off
    assert "fixed_token" not in off.describe() and off.vocab_size == 320
    assert torch.equal(off.train_blocks[7], torch.from_numpy(natural(off, 7)))
    with pytest.raises(ConfigCompositionException) as refused:  # the typed schema refuses it while composing
        compose([*common, "data.fixed_token.position=two"])
    assert hydra_error_message(refused.value) == ("data.fixed_token.position='two' is not allowed; allowed: an "
                                                  "integer >= 1 or null")


def test_fixed_existing_token_keeps_the_vocabulary(env):
    dm = make_dm(env, fixed_token={"position": 1, "token_id": 7}, pad_vocab_to_multiple_of=1)
    assert dm.vocab_size == 300
    blocks = torch.stack([dm.train_blocks[i] for i in range(50)])
    assert (blocks[:, 0] == 7).all()
    with pytest.raises(UserError, match="token_id=300 is outside the tokenizer's ids 0..299"):
        make_dm(env, fixed_token={"position": 1, "token_id": 300})


def test_new_token_grows_the_padded_vocabulary(env):
    assert make_dm(env, pad_vocab_to_multiple_of=1, fixed_token={"position": 1, "token_id": None}).vocab_size == 301
    assert make_dm(env, pad_vocab_to_multiple_of=1).vocab_size == 300


def test_bos_is_prepended_to_training_blocks(env):
    dm = make_dm(env, bos=True)
    for i in (0, 1, 99):
        block = dm.train_blocks[i]
        assert block[0] == dm.eos_id and block.shape == (33,)
        assert torch.equal(block[1:], torch.from_numpy(natural(dm, i, length=32)))  # shifted, not overwritten


def test_controls_leave_validation_and_probe_natural(env):
    plain = make_dm(env)
    for kw in (dict(random_positions=[1, 2]), dict(fixed_token={"position": 1, "token_id": None}),
               dict(max_unique_tokens=2000)):
        dm = make_dm(env, **kw)
        assert torch.equal(torch.cat(list(dm.val_dataloader())), torch.cat(list(plain.val_dataloader())))
        assert torch.equal(dm.probe_tokens(), plain.probe_tokens())
    assert torch.equal(make_dm(env, bos=True).probe_tokens(), plain.probe_tokens())  # data.probe_bos decides
    probe_bos = make_dm(env, probe_bos=True).probe_tokens()
    assert (probe_bos[:, 0] == plain.eos_id).all() and torch.equal(probe_bos[:, 1:], plain.probe_tokens()[:, :-1])


def test_bos_is_prepended_to_validation_blocks_as_to_training_blocks(env):
    """data.bos: the validation blocks are on the training distribution, BOS and then the plain block's text shifted
    by one (same offsets), and that is what `sinklab quant` and `sinklab eval intervene` read."""
    from sinklab.runs.run_data import val_blocks

    plain, dm = torch.cat(list(make_dm(env).val_dataloader())), make_dm(env, bos=True)
    val = torch.cat(list(dm.val_dataloader()))
    assert val.shape == plain.shape and (val[:, 0] == dm.eos_id).all() and (plain[:, 0] != dm.eos_id).any()
    assert torch.equal(val[:, 1:], plain[:, :-1])
    assert dm.train_blocks[0][0] == val[0, 0]
    assert torch.equal(torch.cat(val_blocks(dm, None)), val) and len(val_blocks(dm, 1)) == 1


def test_invalid_controls_are_refused_before_loading(env):
    cases = [
        (dict(random_positions=[0]), "position 0 is outside 1..block_size=32"),
        (dict(random_positions=[33]), "position 33 is outside"),
        (dict(random_positions=[2, 2]), "repeats a position"),
        (dict(random_positions="1"), "random_positions='1' is not allowed; allowed: a list of positions"),
        (dict(fixed_token={"position": 40}), "fixed_token.position=40 is outside"),
        (dict(fixed_token={"pos": 1}), r"unknown key\(s\) \['pos'\]"),
        (dict(fixed_token={"position": 2}, random_positions=[2]), "also in data.random_positions"),
        (dict(bos=True, random_positions=[1]), "bos=true puts BOS at position 1"),
        (dict(bos=True, fixed_token={"position": 1}), "bos=true puts BOS at position 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=message):
            LMDataModule(block_size=32, **kwargs)  # the default corpus: nothing is fetched by the constructor
