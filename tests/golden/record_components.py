"""Record, for every option of every model/ config group, the model's initial parameters and the loss of a few
AdamW steps on fixed tokens; tests/golden/test_golden.py checks that the current code reproduces them (the
parameters exactly, the losses within the spread between kernel sets and thread counts).

components.json was recorded with sinklab before the plug-in redesign (commit a63b302), on an AMD EPYC with
AVX-512, torch's 2 threads:  python tests/golden/record_components.py
token_losses.json (the initial model's loss at every position, a finer check than the mean loss) was recorded on
the same kind of machine (AMD EPYC, AVX-512 kernels, 2 threads, torch 2.13.0) at issue 24:
    python tests/golden/record_components.py --token-losses
"""
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SMALL = dict(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24)


def options() -> list[str]:
    conf = HERE.parents[1] / "conf" / "model"
    return sorted(f"model/{g.name}={f.stem}" for g in conf.iterdir() if g.is_dir() for f in g.glob("*.yaml"))


def model_config(option: str):
    from sinklab.config import compose

    cfg = compose([option])
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(cfg.model, resolve=True)
    d.update(SMALL)
    if d.get("prefix_len", 0) >= SMALL["block_size"]:
        d["prefix_len"] = 8
    if d.get("window") and d["window"] > SMALL["block_size"]:
        d["window"] = 8
    return {k: v for k, v in d.items() if k not in ("_target_", "preset")}


def run(make_model, cfg: dict) -> dict:
    """Initial parameters (float64 sum and absolute sum of each) and 3 AdamW losses on fixed tokens, with torch's
    current thread count (recorded with 2): the last bits of a loss depend on the kernel set and the thread count,
    which tests/golden/test_golden.py allows for with tolerances measured by scripts/golden_spread.py."""
    torch.manual_seed(0)
    model = make_model(cfg)
    params = [[name, float(p.detach().double().sum()), float(p.detach().double().abs().sum())]
              for name, p in model.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = fixed_tokens(cfg)
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"config": cfg, "params": params, "losses": losses}


def fixed_tokens(cfg: dict) -> torch.Tensor:
    """The 4 sequences of block_size + 1 token ids every golden of a component is measured on."""
    return torch.randint(0, cfg["vocab_size"], (4, cfg["block_size"] + 1), generator=torch.Generator().manual_seed(1))


def token_losses(make_model, cfg: dict) -> list[float]:
    """The initial model's cross-entropy at each of the 4 x block_size positions of the fixed tokens. Unlike the mean
    loss (flat to first order in the logits at initialisation, and after a few AdamW steps dominated by how each
    kernel set rounds the near-zero gradients Adam normalises), each term moves with the logits: a changed norm_eps
    or softmax scale shows here."""
    torch.manual_seed(0)
    model = make_model(cfg)
    tokens = fixed_tokens(cfg)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").tolist()


if __name__ == "__main__":
    from sinklab.model import ModelConfig, Transformer

    def make(c):
        return Transformer(ModelConfig(**c))

    if sys.argv[1:] == ["--token-losses"]:  # token_losses.json, for the options components.json has
        recorded = json.loads((HERE / "components.json").read_text())
        out = {opt: token_losses(make, rec["config"]) for opt, rec in sorted(recorded.items())}
        (HERE / "token_losses.json").write_text(json.dumps(out, indent=0) + "\n")
    else:
        out = {opt: run(make, model_config(opt)) for opt in options()}
        (HERE / "components.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"recorded {len(out)} options", file=sys.stderr)
