"""Small models, token batches, checkpoints, recorded activations, and the configurations that select every
registered component (the generic contract tests run over them; sinklab.contracts holds what `sinklab
check-component` shares with them)."""
from pathlib import Path

import torch

# the generic contract checks' models, tokens and cases, shared with `sinklab check-component`
from sinklab.contracts.component_checks import (SMALL, assert_same_logits_and_grads, case_id, component_cases,  # noqa: F401
                                          explicit_paths, logits_and_grads, refused, small_model, token_ids)
from sinklab.model import Transformer

def save_ckpt(model: Transformer, path: Path) -> Path:
    """A checkpoint of `model` as training writes one (the weights under model.*, the model config): what
    sinklab.load_model and the commands read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model": model.cfg.to_dict(), "optim": {"lr": 1e-3, "weight_decay": 0.1},
                                     "max_steps": 1}}, path)
    return path


def covering(cases: list[dict]) -> list[dict]:
    """A subset of `cases` in which every (key, value) that any of them has appears at least once: each component
    and every value of each of its knobs, without their full product (greedy: the case adding the most unseen pairs
    first, ties in the given order)."""
    seen, out = set(), []
    for component in dict.fromkeys(next(iter(c.items())) for c in cases):
        own = [c for c in cases if next(iter(c.items())) == component]
        while True:
            best = max(own, key=lambda c: len(set(c.items()) - seen))
            if not set(best.items()) - seen:
                break
            out.append(best)
            seen |= set(best.items())
    return out


def explicit_logits(m: Transformer, idx: torch.Tensor) -> torch.Tensor:
    """The logits with every layer through its explicit maps (the fused kernels off for this forward)."""
    with explicit_paths(m):
        return m(idx)


def layer_records(m: Transformer, idx: torch.Tensor, explicit: bool = False, extra_mask=None) -> list[dict]:
    """Per layer, q, k, v as the operation sees them (after RoPE, with bias slots and sink tokens) and the block
    output h (the residual stream, sink tokens first), recorded by forward hooks on the model's hook points (under an
    intervention's `extra_mask` if given)."""
    layers: list[dict] = [{} for _ in m.blocks]
    handles = []
    for rec, block in zip(layers, m.blocks):
        for name, point in (("q", block.attn.hook_q), ("k", block.attn.hook_k), ("v", block.attn.hook_v),
                            ("h", block.hook_resid)):
            handles.append(point.register_forward_hook(lambda _m, _i, out, rec=rec, name=name: rec.update({name: out})))
    try:
        with explicit_paths(m, explicit):
            m(idx, extra_mask=extra_mask)
    finally:
        for h in handles:
            h.remove()
    return layers


def training_peak(T: int, device: str = "cpu", **overrides) -> int:
    """Peak tensor bytes of one forward + backward of a 1-layer model at T tokens, batch 1, on `device` (gradients
    already allocated: the measured step holds the same)."""
    from sinklab.model import ModelConfig
    from sinklab.train.throughput import peak_memory

    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, d_ff=64, block_size=T,
                                **overrides)).to(device)
    idx = token_ids(B=1, T=T, vocab=64).to(device)

    def step():
        torch.nn.functional.cross_entropy(m(idx)[0], idx[0]).backward()
    step()
    return peak_memory(step, torch.device(device))
