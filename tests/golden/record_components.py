"""Record, for every option of every model/ config group, the model's initial parameters and the loss of a few
AdamW steps on fixed tokens; tests/test_golden.py checks that the current code reproduces them bit for bit.

Recorded with sinklab before the plug-in redesign (commit a63b302):  python tests/golden/record_components.py
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
    """Recorded with torch's 2 threads (a 2-core machine's default): the sums of parallel reductions, and so the last
    bits of a loss, depend on the thread count, so the test runs with the same count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _run(make_model, cfg)
    finally:
        torch.set_num_threads(threads)


def _run(make_model, cfg: dict) -> dict:
    torch.manual_seed(0)
    model = make_model(cfg)
    params = [[name, float(p.detach().double().sum()), float(p.detach().double().abs().sum())]
              for name, p in model.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab_size"], (4, cfg["block_size"] + 1), generator=g)
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"config": cfg, "params": params, "losses": losses}


if __name__ == "__main__":
    from sinklab.model import ModelConfig, Transformer

    out = {opt: run(lambda c: Transformer(ModelConfig(**c)), model_config(opt)) for opt in options()}
    (HERE / "components.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"recorded {len(out)} options", file=sys.stderr)
