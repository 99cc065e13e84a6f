"""Retrieval tasks (sinklab/data/retrieval/): passkey and mqar samples, their answers and chance levels, their mixing
into training blocks at data.retrieval.rate, the held-out validation samples, the one-line errors, and a short
training run logging val/retrieval/*."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, models

from sinklab.data import LMDataModule
from sinklab.data.retrieval import (MQAR, TASKS, VAL_SEED, Passkey, RetrievalConfig, answer_scores, digit_ids,
                                    make_samples)
from sinklab.errors import UserError
from sinklab.metrics.base import bounds
from tests.helpers import assert_one_line_error, bpe_corpus, corpus_dm, small, train

DIGITS = list(range(48, 58))  # stand-ins for the tokenizer's "0".."9" ids
V = 1024


def passkey(**knobs) -> Passkey:
    return Passkey(V, DIGITS, bos_id=0, reserved=(0,), **knobs)


def mqar(**knobs) -> MQAR:
    return MQAR(V, bos_id=0, reserved=(0,), **knobs)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return bpe_corpus(tmp_path_factory.mktemp("retrieval"), 10, 2000, 300)


make_dm = corpus_dm


# ---------------------------------------------------------------------------------------------- samples


@pytest.mark.parametrize("task", [passkey(), mqar()], ids=["passkey", "mqar"])
def test_samples_are_a_function_of_the_seed(task):
    filler = np.arange(2000, 2500)
    a, b = make_samples(task, 6, 65, 3, filler), make_samples(task, 6, 65, 3, filler)
    assert all(np.array_equal(x.tokens, y.tokens) and np.array_equal(x.answer, y.answer) and x.ask == y.ask
               for x, y in zip(a, b))
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(make_samples(task, 3, 65, 3, filler), a))
    other = make_samples(task, 6, 65, 4, filler)
    assert not all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, other))
    for s in a:
        assert s.tokens.dtype == np.int64 and s.answer.dtype == bool and s.tokens.shape == s.answer.shape == (65,)
        assert s.tokens[0] == 0 and not s.answer[:s.ask + 1].any()  # BOS first; nothing to answer before the question


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_puts_the_key_at_its_depth_and_asks_for_it_at_the_end(depth):
    task, L, k = passkey(depth=depth, key_len=5), 65, 5
    n_fill = L - 1 - 2 - 2 * k
    filler = np.arange(2000, 2500)  # consecutive ids: the filler's run shows through
    for s in make_samples(task, 20, L, 0, filler):
        t = s.tokens
        key_at = int(np.flatnonzero(t == task.key_id)[0])
        assert list(t == task.key_id).count(True) == 1 and list(t == task.query_id).count(True) == 1
        assert key_at == 1 + math.floor(depth * n_fill + 0.5)  # after BOS and `depth` of the filler
        key = t[key_at + 1:key_at + 1 + k]
        assert set(key) <= set(DIGITS)
        assert s.ask == L - k - 1 and t[s.ask] == task.query_id
        assert np.array_equal(t[s.ask + 1:], key)                         # the answer is the key
        assert np.array_equal(np.flatnonzero(s.answer), np.arange(L - k, L))
        text = np.concatenate([t[1:key_at], t[key_at + 1 + k:s.ask]])
        assert len(text) == n_fill and np.array_equal(np.diff(text), np.ones(n_fill - 1))  # one contiguous run


@pytest.mark.parametrize("query_at,depth", [(0.0, 0.5), (0.3, 0.0), (0.6, 1.0), (None, 0.5), (None, None)])
def test_passkey_query_at_places_the_question_and_the_text_goes_on_after_the_answer(query_at, depth):
    task, L, k = passkey(depth=depth, key_len=3, query_at=query_at), 65, 3
    n_fill = L - 1 - 2 - 2 * k
    filler = np.arange(2000, 2500)
    places = []
    for s in make_samples(task, 300, L, 0, filler):
        t = s.tokens
        key_at, ask = int(np.flatnonzero(t == task.key_id)[0]), int(np.flatnonzero(t == task.query_id)[0])
        before = ask - 1 - 1 - k  # filler tokens before QUERY
        if query_at is not None:
            assert before == math.floor(query_at * n_fill + 0.5)
        if depth is not None:
            assert key_at - 1 == math.floor(depth * before + 0.5)
        assert s.ask == ask and np.array_equal(t[ask + 1:ask + 1 + k], t[key_at + 1:key_at + 1 + k])
        assert np.array_equal(np.flatnonzero(s.answer), np.arange(ask + 1, ask + 1 + k))
        text = np.concatenate([t[1:key_at], t[key_at + 1 + k:ask], t[ask + 1 + k:]])
        assert len(text) == n_fill and np.array_equal(np.diff(text), np.ones(n_fill - 1))  # one run, on after
        places.append(before / n_fill)
    if query_at is None:  # uniform: questions anywhere, the answer's tokens at every position of the block
        assert abs(np.mean(places) - 0.5) < 0.05 and min(places) < 0.03 and max(places) > 0.97


def test_passkey_query_at_is_drawn_after_the_key():
    """A null query_at is drawn after the key (and a null depth): a seed's keys are those of query_at=1, the default,
    which draws nothing, so that samples made before the knob existed are made again."""
    filler = np.arange(2000, 2500)
    at_end, anywhere = (make_samples(passkey(query_at=q), 50, 65, 5, filler) for q in (1.0, None))
    assert [list(x.tokens[x.answer]) for x in at_end] == [list(y.tokens[y.answer]) for y in anywhere]
    assert {x.ask for x in at_end} == {65 - 4 - 1} and len({y.ask for y in anywhere}) > 10


def test_a_run_trained_with_questions_anywhere_is_read_with_the_question_at_the_end():
    from sinklab.evals.retrieval import read_at_end

    task = passkey(query_at=None)
    at_end = read_at_end(task, "depth")
    assert at_end.query_at == 1.0 and at_end.knobs["query_at"] == 1.0 and task.query_at is None
    assert {s.ask for s in make_samples(at_end, 20, 65, 0, None)} == {65 - 4 - 1}
    assert read_at_end(task, "query_at") is task and read_at_end(passkey(query_at=0.5), "depth").query_at == 0.5
    assert read_at_end(mqar(), "n_pairs").knobs == mqar().knobs


def test_passkey_depth_null_is_uniform_and_keys_are_uniform_digits():
    task, L = passkey(), 65
    samples = make_samples(task, 2000, L, 1, None)
    places = np.array([np.flatnonzero(s.tokens == task.key_id)[0] - 1 for s in samples]) / (L - 1 - 2 - 8)
    assert abs(places.mean() - 0.5) < 0.03 and places.min() < 0.02 and places.max() > 0.98
    assert np.histogram(places, bins=4, range=(0, 1))[0].min() > 400  # every quarter of the filler
    digits = np.concatenate([s.tokens[s.answer] for s in samples])
    counts = np.bincount(digits - DIGITS[0], minlength=10)
    assert counts.min() > 0.8 * len(digits) / 10
    fill = np.concatenate([s.tokens[1:-10] for s in samples])
    assert fill.min() >= 1 and fill.max() < V + 2  # random filler: ordinary ids, never the BOS


def test_mqar_queries_each_key_once_with_the_value_of_its_pair():
    task, L, n = mqar(n_pairs=8), 65, 8
    for s in make_samples(task, 200, L, 2, None):
        t, body = s.tokens, s.tokens[1:]
        keys, values = body[0:2 * n:2], body[1:2 * n:2]
        assert len(set(keys)) == len(set(values)) == n
        assert keys.min() >= 1 and keys.max() < V // 2 and values.min() >= V // 2 and values.max() < V
        answers = np.flatnonzero(s.answer)
        assert len(answers) == n and (answers > 2 * n + 1).all()
        pairs = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(t[answers - 1].tolist()) == sorted(keys.tolist())        # every key asked once
        assert all(pairs[int(t[a - 1])] == t[a] for a in answers)              # answered with its pair's value
        assert ((answers - 1 - (1 + 2 * n)) % 2 == 0).all()                   # a query starts a two-token slot
        assert s.ask == answers.min() - 1 and t[s.ask] in pairs


def test_mqar_gaps_follow_zoologys_power_law_skewed_short():
    """One pair: the query slot's distribution is p(i) ~ i^(a - 1) itself; 8 pairs: the slots are short far more
    often than uniform (power_a = 1)."""
    task, L = mqar(n_pairs=1), 65
    p = task.gap_probabilities(L)
    slots = np.array([(s.ask - 3) // 2 for s in make_samples(task, 4000, L, 5, None)])
    freq = np.bincount(slots, minlength=len(p)) / len(slots)
    assert len(p) == (64 - 2) // 2 and p[0] > 4 * p[-1] and np.all(np.diff(p) < 0)
    assert np.abs(freq - p).max() < 0.03, (freq[:4], p[:4])

    def slots_of(power_a):
        task = mqar(n_pairs=8, power_a=power_a)
        return np.concatenate([(np.flatnonzero(s.answer) - 1 - 17) // 2
                               for s in make_samples(task, 500, L, 6, None)])
    short, uniform = slots_of(0.01), slots_of(1.0)
    space = (64 - 16) // 2
    assert abs(uniform.mean() - (space - 1) / 2) < 0.5
    assert short.mean() < uniform.mean() - 2 and (short < space // 4).mean() > 1.5 * (uniform < space // 4).mean()


def test_chance_levels():
    assert passkey(key_len=4).chance() == pytest.approx(1e-4) and passkey(key_len=2).chance() == pytest.approx(0.01)
    assert mqar().chance() == pytest.approx(1 / 512)  # values [512, 1024)
    assert MQAR(300, reserved=(0,)).chance() == pytest.approx(1 / 150)


def test_answer_scores_count_exact_spans():
    task = mqar(n_pairs=4)
    samples = make_samples(task, 3, 33, 0, None)
    tokens = torch.stack([torch.from_numpy(s.tokens) for s in samples])  # (3, 33)
    answer = torch.stack([torch.from_numpy(s.answer) for s in samples])
    logits = torch.full((3, 32, V), -20.0)
    logits.scatter_(2, tokens[:, 1:, None], 20.0)  # every target predicted
    loss, acc = answer_scores(logits, tokens, answer)
    assert acc == 1 and 0 <= loss < 1e-6
    row, col = torch.nonzero(answer)[0].tolist()
    logits[row, col - 1, tokens[row, col]] = -20.0  # one value wrong (a uniform guess): one span of 12
    loss, acc = answer_scores(logits, tokens, answer)
    assert acc == pytest.approx(11 / 12) and loss == pytest.approx(math.log(V) / 12, rel=1e-4)
    pk = passkey(key_len=4)
    s = make_samples(pk, 2, 33, 0, None)
    tokens = torch.stack([torch.from_numpy(x.tokens) for x in s])
    answer = torch.stack([torch.from_numpy(x.answer) for x in s])
    logits = torch.full((2, 32, V + 2), -20.0).scatter_(2, tokens[:, 1:, None], 20.0)
    logits[0, -1, tokens[0, -1]] = -20.0  # the last digit of sample 0 wrong: its whole key is wrong
    assert answer_scores(logits, tokens, answer)[1] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("settings,expected", [
    ({"task": "copy"}, "data.retrieval.task='copy' is not allowed; allowed: null or one of passkey, mqar"),
    ({"task": "passkey", "rate": 1.5}, "data.retrieval.rate=1.5 is not allowed; allowed: a number >= 0 and <= 1"),
    ({"task": "passkey", "depth": -0.1}, "data.retrieval.depth=-0.1 is not allowed; allowed: a number >= 0 and <= 1"),
    ({"task": "passkey", "query_at": 2}, "data.retrieval.query_at=2 is not allowed; allowed: a number >= 0 and <= 1"),
    ({"rate": 0.5}, "data.retrieval.rate=0.5 needs data.retrieval.task: one of passkey, mqar"),
    ({"task": "passkey", "key_len": 15}, "data.retrieval.key_len=15 is not allowed; allowed: an integer <= 13 (a "
                                         "passkey sample is 2 markers + the key twice = 32 tokens, more than a "
                                         "block's 29"),
    ({"task": "mqar", "n_pairs": 8}, "data.retrieval.n_pairs=8 is not allowed; allowed: an integer <= 7 (mqar "
                                     "needs 4 x n_pairs tokens"),
])
def test_bad_settings_are_one_line_naming_the_key(settings, expected):
    with pytest.raises(UserError) as err:
        LMDataModule(corpus="local", files=["a.txt"], block_size=28, retrieval=settings)
    assert_one_line_error(err, starts=expected)


def test_one_line_errors_of_the_tasks_themselves():
    with pytest.raises(UserError) as err:
        RetrievalConfig(task="passkey", key_len=32).check_length(65, bos=True)
    assert_one_line_error(err, "data.retrieval.key_len=32", "an integer <= 31", "BOS + 2 markers")
    RetrievalConfig(task="passkey", key_len=31).check_length(65, bos=True)  # BOS + 2 + 62 = 65 fits
    with pytest.raises(UserError) as err:
        make_samples("mqar", 2, 64, 0, None, vocab=V, key_len=4)
    assert_one_line_error(err, "data.retrieval.task=mqar has no knob(s) ['key_len']; its knobs: n_pairs, power_a")
    with pytest.raises(UserError) as err:
        make_samples(passkey(), 2, 65, 0, np.arange(10))
    assert_one_line_error(err, "the filler has 10 tokens, fewer than the 54 a sample needs")
    with pytest.raises(UserError) as err:
        TASKS.get("copy")
    assert_one_line_error(err, "data.retrieval.task 'copy' is unknown; allowed: passkey, mqar")
    words = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "0": 2, "1": 3}, unk_token="a"))
    with pytest.raises(UserError) as err:
        digit_ids(words, "data.tokenizer=words.json")
    assert_one_line_error(err, "data.retrieval.task=passkey needs the single-character tokens '0'..'9'",
                          "data.tokenizer=words.json has no '2', '3'")


# ---------------------------------------------------------------------------------------------- the data module


def test_passkey_markers_are_new_ids_after_the_tokenizer_and_a_fixed_token(env):
    plain = make_dm(env)
    dm = make_dm(env, retrieval={"task": "passkey"})  # rate 0: validated, never trained on
    task, size = dm.retrieval_task, 300
    assert plain.retrieval_task is None and (task.key_id, task.query_id) == (size, size + 1)
    assert task.digit_ids.tolist() == [Tokenizer.from_file(env.tok).token_to_id(d) for d in "0123456789"]
    assert plain.vocab_size == 320 and dm.vocab_size == 320  # 302 ids, padded to 64 like 300
    fixed = make_dm(env, retrieval={"task": "passkey"}, fixed_token={"position": 2}, pad_vocab_to_multiple_of=1)
    assert (fixed.retrieval_task.key_id, fixed.retrieval_task.query_id) == (301, 302) and fixed.vocab_size == 303
    assert make_dm(env, retrieval={"task": "mqar"}, pad_vocab_to_multiple_of=1).vocab_size == 300
    assert all(torch.equal(plain.train_blocks[i], dm.train_blocks[i]) for i in range(50))


@pytest.mark.parametrize("name", ["passkey", "mqar"])
def test_training_blocks_are_replaced_at_the_rate_by_seed_and_index(env, name):
    plain = make_dm(env, bos=True)
    dm = make_dm(env, bos=True, retrieval={"task": name, "rate": 0.3})
    blocks, n = dm.train_blocks, 3000
    mixed = [i for i in range(n) if blocks.retrieval_sample(i) is not None]
    assert abs(len(mixed) / n - 0.3) < 0.03  # 3.5 standard deviations
    again = make_dm(env, bos=True, retrieval={"task": name, "rate": 0.3}).train_blocks
    for i in range(0, 400, 7):
        block = blocks[i]
        assert block.shape == (33,) and torch.equal(block, again[i]) and block[0] == dm.eos_id
        sample = blocks.retrieval_sample(i)
        if sample is None:  # the block a run without retrieval reads
            assert torch.equal(block, plain.train_blocks[i])
        else:
            assert torch.equal(block, torch.from_numpy(sample.tokens)) and sample.answer.sum() in (4, 8)
            if name == "passkey":
                assert (block == dm.retrieval_task.key_id).sum() == 1
    assert make_dm(env, retrieval={"task": name}).train_blocks.retrieval_sample(0) is None  # rate 0
    loader = dm.make_train_loader(step=2)
    assert next(iter(loader)).shape == (8, 33)


def test_validation_has_held_out_retrieval_samples_apart(env):
    plain = make_dm(env)
    assert isinstance(plain.val_dataloader(), torch.utils.data.DataLoader)  # default: one loader, as before
    dm = make_dm(env, retrieval={"task": "passkey", "rate": 0.5, "val_num_samples": 12})
    text, retrieval = dm.val_dataloader()
    assert torch.equal(torch.cat(list(text)), torch.cat(list(plain.val_dataloader())))  # val/loss's blocks unchanged
    batches = list(retrieval)
    tokens, answer = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert tokens.shape == answer.shape == (12, 33) and answer.dtype == torch.bool and (answer.sum(1) == 4).all()
    filler = dm._stores["val"]
    expected = make_samples(dm.retrieval_task, 12, 33, VAL_SEED, filler)
    assert torch.equal(tokens, torch.from_numpy(np.stack([s.tokens for s in expected])))
    other_seed = make_dm(env, seed=9, retrieval={"task": "passkey", "rate": 0.5, "val_num_samples": 12})
    assert torch.equal(torch.cat([b[0] for b in other_seed.val_dataloader()[1]]), tokens)  # fixed, held out
    assert dm.describe()["retrieval"]["task"] == "passkey" and dm.describe()["retrieval"]["rate"] == 0.5
    with pytest.raises(UserError, match="data.retrieval.task is null"):
        plain.retrieval_dataloader()


# ---------------------------------------------------------------------------------------------- training


def test_a_short_run_logs_retrieval_loss_and_accuracy_within_bounds(tmp_path, corpus):
    run = train(tmp_path / "run", *small(corpus, "data.retrieval.task=passkey", "data.retrieval.rate=0.5",
                                        "data.retrieval.val_num_samples=8"), recipe=[], job=False, threads=1)
    metrics = pd.read_csv(run.dir / "metrics.csv")
    for key in ("val/retrieval/answer_loss", "val/retrieval/accuracy", "val/loss"):
        values = metrics[key].dropna()
        assert len(values) == 2 and values.map(math.isfinite).all(), key  # steps 4 and 8
        assert values.between(*bounds(key)).all(), (key, values.tolist())
    assert bounds("val/retrieval/accuracy") == (0.0, 1.0) and bounds("val/retrieval/answer_loss")[0] == 0.0
    assert not [c for c in metrics.columns if "dataloader_idx" in c]
    assert run.final["val/retrieval/answer_loss"] > 0


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_text_writes_the_key_and_the_question_in_words_with_no_new_ids(env, depth):
    """passkey_text (for pretrained models): the key and the question are sentences through the data's own tokenizer,
    the vocabulary does not grow, `ask` is the question's first token and the answer the key's digits after it."""
    from sinklab.data.retrieval import KEY_TEXT, QUERY_TEXT

    plain = make_dm(env)
    dm = make_dm(env, retrieval={"task": "passkey_text", "depth": depth, "key_len": 3})
    task, tok = dm.retrieval_task, Tokenizer.from_file(env.tok)
    assert dm.vocab_size == plain.vocab_size and task.n_ids == 300
    for s in make_samples(task, 8, 128, 0, np.arange(100, 228)):
        text = tok.decode(s.tokens.tolist())
        key = tok.decode(s.tokens[s.answer].tolist())
        assert len(key) == 3 and key.isdigit()
        assert f"{KEY_TEXT.strip()} {key}." in text and f"{QUERY_TEXT.strip()} {key}" in text
        assert tok.decode(s.tokens[s.ask:s.ask + len(task.query_text)].tolist()) == tok.decode(task.query_text.tolist())
        assert np.flatnonzero(s.answer)[0] == s.ask + len(task.query_text) and not s.answer[:s.ask].any()
        starts = [i for i in range(len(s.tokens) - len(task.key_text) + 1)
                  if np.array_equal(s.tokens[i:i + len(task.key_text)], task.key_text)]
        n_fill = task.body(128) - len(task.key_text) - len(task.after_key) - len(task.query_text) - 6
        assert starts[0] == (task.bos_id is not None) + math.floor(depth * n_fill + 0.5)  # at `depth` of the filler
