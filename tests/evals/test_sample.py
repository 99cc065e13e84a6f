"""sinklab sample: cached decoding against recomputing the prefix, StreamingLLM eviction past the context, the command
on a real trained run (its tokenizer and BOS token), the documentation's lines, user errors."""
from __future__ import annotations

import json

import pytest
import torch

from sinklab.evals.sampling import generate, kept, pick
from tests.helpers import assert_one_line_error, readme_cli_lines, run_cli, save_ckpt, small_model, token_ids


def test_greedy_cached_sampling_equals_recomputing_the_prefix_on_a_trained_run(trained_run):
    from sinklab.runs.checkpoints import load_model

    model = load_model(trained_run / "checkpoints" / "last.ckpt")
    prompt = torch.tensor([[0, 464, 262, 286, 290]])  # BOS, then a few ids of the 1024 BPE
    cached = generate(model, prompt, 59, temperature=0)  # 64 tokens in all: the whole context, nothing evicted
    recomputed = generate(model, prompt, 59, temperature=0, cached=False)
    assert torch.equal(cached, recomputed)
    assert len(set(cached[0].tolist())) > 5  # a trained model, not one token repeated
    # sampling too: the same draws pick the same tokens when the two paths give the same probabilities
    draws = [generate(model, prompt, 59, temperature=1.0, generator=torch.Generator().manual_seed(3), cached=c)
             for c in (True, False)]
    assert torch.equal(*draws) and not torch.equal(draws[0], cached)


@pytest.mark.parametrize("case", [{}, {"n_sink_tokens": 2}, {"attn_bias": "kv", "pos": "alibi"}],
                         ids=["rope", "sink_tokens", "kv_bias_alibi"])
def test_past_the_context_the_cache_keeps_the_first_4_and_the_recent_tokens(case):
    """A 1-layer model (a cached key depends on its token only): cached decoding past the context of 24 equals
    recomputing [first 4] + [last 20] at every step, for prompts shorter and longer than the context. (Not with
    absolute positions: those are added to the embeddings, so a kept key keeps the position it was computed at.)"""
    m = small_model(n_layer=1, **case)
    with torch.no_grad():  # sharper logits than the random init, so that greedy decoding moves
        m.lm_head.weight.mul_(20.0)
    for prompt in (token_ids(B=1, T=5), token_ids(B=1, T=30, seed=1)):
        cached = generate(m, prompt, 40, temperature=0)
        assert cached.shape == (1, 40)
        assert torch.equal(cached, generate(m, prompt, 40, temperature=0, cached=False))
        assert len(set(cached[0].tolist())) > 3
    idx = torch.arange(30)[None]
    assert kept(idx, 4, 24).tolist() == [[0, 1, 2, 3] + list(range(10, 30))]
    assert torch.equal(kept(idx[:, :24], 4, 24), idx[:, :24])


def test_pick_greedy_top_k_and_allowed_ids():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0]])
    assert pick(logits, 0, None, None).tolist() == [[3]]
    assert pick(logits, 0, None, None, allowed=3).tolist() == [[1]]  # id 3 is past the tokenizer's ids
    g = torch.Generator().manual_seed(0)
    draws = {pick(logits, 1.0, 2, g).item() for _ in range(200)}
    assert draws == {1, 3}  # only the two most likely
    draws = {pick(logits, 5.0, None, g, allowed=3).item() for _ in range(200)}
    assert draws == {0, 1, 2}


def test_sample_on_a_trained_run(capsys, trained_run):
    rc, out, err = run_cli("sinklab", "sample", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "30",
                           "--seed", "1", "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["prompt_tokens"][0] == 0 and res["bos"] is True  # the default data starts blocks with BOS (id 0)
    assert len(res["tokens"]) == 30 and max(res["tokens"]) < 1024 and not res["evicted"]
    assert res["text"] and res["keep_first"] == 4 and res["tokens_per_s"] > 0
    rc, again, err = run_cli("sinklab", "sample", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "30",
                             "--seed", "1", "--json", capsys=capsys)
    assert json.loads(again)["tokens"] == res["tokens"]  # the seed fixes the draws
    rc, text, err = run_cli("sinklab", "sample", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "100",
                            "--temperature", "0", capsys=capsys)
    assert rc == 0, err
    assert text.startswith("ROMEO:") and len(text) > 50
    # past the context of 64 the cache evicts (and says so in --json); the checkpoint with --data finds the tokenizer
    rc, out, err = run_cli("sinklab", "sample", str(trained_run / "checkpoints" / "last.ckpt"), "--data",
                           str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "100", "--temperature", "0",
                           "--json", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["evicted"] and text == "ROMEO:" + res["text"] + "\n"


def test_readme_sample_commands_run(capsys, trained_run):
    commands = readme_cli_lines("sinklab sample", {"runs/a": trained_run})
    assert len(commands) >= 2
    for args in commands:
        rc, out, err = run_cli("sinklab", *args, capsys=capsys)
        assert rc == 0, (args, err)
        assert out.startswith(args[args.index("--prompt") + 1]), out
    rc, out, err = run_cli("sinklab", "sample", "--help", capsys=capsys)
    assert rc == 0 and "keeps the first 4 tokens and the most recent" in " ".join(out.split())


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature -1: allowed: >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be a positive integer"),
    (["--top-k", "0"], "--top-k 0 must be a positive integer"),
    (["--data", "NOT_A_RUN"], "not a run dir (it has no .hydra/config.yaml)"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, trained_run, tmp_path, args, message):
    args = [str(tmp_path) if a == "NOT_A_RUN" else a for a in args]
    rc, out, err = run_cli("sinklab", "sample", str(trained_run), "--prompt", "To be", *args, capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, message)


def test_a_bare_checkpoint_needs_a_run_for_its_tokenizer(capsys, tmp_path):
    ckpt = save_ckpt(small_model(), tmp_path / "m.ckpt")
    rc, out, err = run_cli("sinklab", "sample", str(ckpt), "--prompt", "To be", capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "has no run config", "pass --data RUN_DIR")
    rc, out, err = run_cli("sinklab", "sample", str(tmp_path / "missing"), "--prompt", "To be", capsys=capsys)
    assert rc == 2 and "no such checkpoint or run dir" in err, err
    rc, out, err = run_cli("sinklab", "sample", str(ckpt), capsys=capsys)
    assert rc == 2
    assert_one_line_error(err, "--prompt")


@pytest.mark.slow
@pytest.mark.ci
def test_sampling_through_another_cache_policy(capsys, trained_run):
    """--policy window --budget 63 is StreamingLLM's cache without its first tokens; greedy decoding with a budget
    that holds the whole text is the default's; a bad policy setting is one line."""
    base = ["sample", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--temperature", "0", "--json"]
    rc, out, err = run_cli("sinklab", *base, capsys=capsys)
    default = json.loads(out)
    rc, out, err = run_cli("sinklab", *base, "--policy", "h2o", "--budget", "40", "--knob", "recent=0.25", capsys=capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["tokens"] == default["tokens"] and not res["evicted"]  # 27 tokens: nothing evicted
    assert res["policy"] == {"policy": "h2o", "budget": 40, "recent": 0.25, "normalize": False}  # every knob
    assert res["keep_first"] is None
    rc, out, err = run_cli("sinklab", *base[:5], "100", *base[6:], "--policy", "window", "--budget", "16",
                           capsys=capsys)
    assert rc == 0 and json.loads(out)["evicted"], err
    for args, message in ((["--policy", "h2o", "--budget", "64"], "budget 64 must be < the model context 64"),
                          (["--budget", "8"], "--budget / --knob go with --policy NAME"),
                          (["--policy", "lru"], "cache policy 'lru' is unknown; allowed: dense, streaming")):
        rc, out, err = run_cli("sinklab", *base, *args, capsys=capsys)
        assert rc == 2
        assert_one_line_error(err, message)
