"""sinklab export-hf for every registered component: a tiny random model with the component switched on is exported
(`sinklab.export.llama.export`: LlamaForCausalLM where LLaMA can represent it, else the remote code of
`sinklab.export.remote`), loaded back with transformers (`trust_remote_code=True` for remote code), and its logits
equal sinklab's (fp32, <= 1e-5 relative); greedy `generate` through transformers' cache equals sinklab's greedy
decoding by full forwards, and the remote code's `output_attentions` maps are sinklab's. The components come from
the registries (one case of each, `component_cases`), with the base config's own switches (learned sink tokens, the
masks, the softmax scale, the residual clamp, a head width of its own, a layer pattern)."""
from __future__ import annotations

import json

import pytest
import torch

from sinklab.contracts.component_checks import MASKS
from sinklab.export.llama import export
from sinklab.metrics.record import attention_maps
from sinklab.model import FAMILIES, ModelConfig, Transformer
from tests.helpers import case_id, component_cases, save_ckpt

TINY = dict(vocab_size=64, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=16)
T = 16
NEW_TOKENS = 4
REL_TOL = 1e-5
# the base config's own switches (not components of a registry): what LLaMA cannot represent beside them
BASE = [{"n_sink_tokens": 2}, *(m for m in MASKS.values() if m), {"softmax_scale": 1.5}, {"residual_clip": 3.0},
        {"head_dim": 16}, {"layer_pattern": "LG", "window": 4}]


def one_case_each() -> list[dict]:
    """One case of every registered component (its first: component_cases), then the base switches."""
    first = {}
    for case in component_cases():
        first.setdefault(next(iter(case.items())), case)
    registered = {(r.key, name) for r in FAMILIES for name in r.names()}
    assert set(first) == registered, f"components without a buildable case: {registered - set(first)}"
    return list(first.values()) + BASE


CASES = one_case_each()


def tiny_model(case: dict) -> Transformer:
    """The case's tiny model with random weights everywhere (norm gains, gates' and biases' parameters included: a
    mapping slip would show), at a late training step."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **case})).eval()
    model.set_step(10 ** 6)  # past every warm-up (DSA's dense steps): the step is exported too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() < 2:
                p.normal_(0.0, 0.3)
    return model


@torch.no_grad()
def greedy(model: Transformer, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens after prompt (B, P), each from a full forward over the sequence so far: (B, P + n)."""
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_every_component_exports_with_sinklabs_logits(case, tmp_path):
    transformers = pytest.importorskip("transformers")  # its remote code goes to HF_MODULES_CACHE (tests/conftest.py)
    model = tiny_model(case)
    out = tmp_path / "export"  # one name for every case: the remote code's module is imported once
    result = export(str(save_ckpt(model, tmp_path / "m.ckpt")), str(out), check=False, with_tokenizer=False,
                    log=lambda line: None)
    config = json.loads((out / "config.json").read_text())
    remote = not model.cfg.llama_compatible
    assert result["architecture"] == config["architectures"][0] == ("SinklabForCausalLM" if remote
                                                                    else "LlamaForCausalLM")
    assert ("auto_map" in config) == remote and (out / "modeling_sinklab.py").is_file() == remote
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=remote,
                                                           local_files_only=True).eval()
    idx = torch.randint(0, TINY["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(input_ids=idx).logits
    assert ours.abs().max() > 0.1
    assert ((ours - theirs).abs().max() / ours.abs().max()).item() <= REL_TOL

    prompt = idx[:, :T - NEW_TOKENS]
    calls = []  # the lengths each forward of sinklab's model is given: the prompt, then one token at a time
    hook = (hf.model.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[1])) if remote else None)
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                            do_sample=False, pad_token_id=0)
    assert torch.equal(generated, greedy(model, prompt, NEW_TOKENS))
    if remote:
        hook.remove()
        assert calls == [T - NEW_TOKENS] + [1] * (NEW_TOKENS - 1)  # decoded through the cache, not recomputed
        with torch.no_grad():
            maps = hf(input_ids=idx, output_attentions=True).attentions
        extra = model.cfg.n_slots + model.cfg.n_sink_tokens
        want = [a[:, :, -T:, extra:] for a in attention_maps(model, idx)]
        assert len(maps) == model.cfg.n_layer
        assert all(m.shape == (2, TINY["n_head"], T, T) and torch.allclose(m, w, atol=1e-6) for m, w in zip(maps, want))
