"""Small models, token batches, checkpoints, and the configurations that select every registered component (the
generic contract tests run over them)."""
import itertools
from pathlib import Path

import torch

from sinklab.model import FAMILIES, ConfigError, ModelConfig, Transformer
from sinklab.model.config import KNOBS

SMALL = dict(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24)


def small_model(**overrides) -> Transformer:
    """A 2-layer, d 32 model with seed 0, in eval mode."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**SMALL, **overrides})).eval()


def token_ids(B: int = 2, T: int = 24, seed: int = 0, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def save_ckpt(model: Transformer, path: Path) -> Path:
    """A checkpoint of `model` as training writes one (the weights under model.*, the model config): what
    sinklab.load_model and the commands read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model": model.cfg.to_dict(), "optim": {"lr": 1e-3, "weight_decay": 0.1},
                                     "max_steps": 1}}, path)
    return path


def component_cases() -> list[dict]:
    """One config (overrides of SMALL) per registered component of every family, and per value of each choice or
    boolean knob it owns (softmax x sink_logit, kernel x kernel_map x attn_normalize, ...) and of each knob that lists
    values to try in `metadata={"cases": (...)}` (rope x rope_fraction x nope_every), except the combinations the
    component's `validate` refuses (a head-shared gate after the output projection). A component that needs
    logits is paired with a position that works with it (the registry's defaults otherwise)."""
    cases = []
    for registry in FAMILIES:
        for cls in registry:
            owned = [(k, f) for k, (f, owners) in KNOBS.items() if cls in owners]
            axes = [[(k, c) for c in f.metadata["choices"]] for k, f in owned if "choices" in f.metadata]
            axes += [[(k, False), (k, True)] for k, f in owned if f.type in (bool, "bool")]
            axes += [[(k, c) for c in f.metadata["cases"]] for k, f in owned if "cases" in f.metadata]
            for combo in itertools.product(*axes):
                case = {registry.key: cls.name, **dict(combo)}
                if not refused(case):
                    cases.append(case)
    return cases


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


def refused(case: dict) -> bool:
    try:
        ModelConfig(**{**SMALL, **case})
    except ConfigError:
        return True
    return False


def case_id(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items())


def logits_and_grads(m, idx, **kw):
    m.zero_grad()
    out = m(idx, **kw)
    logits = out[0] if isinstance(out, tuple) else out
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def assert_same_logits_and_grads(got, want):
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        # float32 sums make an error relative to the tensor's largest entry (a sink token's gradient reaches
        # ~3e3 and carries ~1e-3 of noise on every entry, its small ones included), so atol grows with it
        atol = 1e-4 + 1e-5 * want[1][name].abs().max().item()
        torch.testing.assert_close(got[1][name], want[1][name], atol=atol, rtol=1e-4, msg=name)
