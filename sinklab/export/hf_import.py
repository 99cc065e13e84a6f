"""sinklab import-hf SRC OUT: a transformers causal LM of the LLaMA family as a sinklab run dir, the inverse of
export-hf (`sinklab.export.llama`).

    sinklab import-hf path/to/model_dir OUT       # a save_pretrained directory
    sinklab import-hf HuggingFaceTB/SmolLM2-135M OUT   # a hub id (huggingface_hub's cache; offline with HF_HUB_OFFLINE=1)
    sinklab import-hf path/to/model.gguf OUT      # a GGUF file, dequantized by transformers' own loader

SRC is loaded the way every `--hf-model` command loads it (`sinklab.targets.transformers_lm.load_hf_model`, fp32).
sinklab's Transformer represents LLaMA exactly (RoPE over the whole head, pre-RMSNorm, SwiGLU, grouped-query
attention, optionally tied embeddings: `model.tie_embeddings`), so the weights map one to one (`LLAMA_NAMES`, the
map export-hf writes with) and the logits agree within `TOLERANCE` (checked on random tokens in float64, the float32
difference shown beside, unless --no-check). Any
other architecture, or a LLaMA config with a feature sinklab's model does not have (biases, another activation,
scaled RoPE, a sliding window), is refused in one line naming the feature.

OUT is a run dir every sinklab command takes, like a training run's:
- `checkpoints/last.ckpt`: the weights (`model.` + sinklab's names), the model config, step 0, and where they came from
  (`sinklab_imported_from`: the source, its class, the GGUF quantization when there is one);
- `tokenizer.json`: the model's tokenizer;
- `.hydra/config.yaml`: `model` (the imported config) and `data`: the default corpus (Shakespeare) read through that
  tokenizer, the model's BOS token first (`data.bos`, `data.eos_token`), and the passkey in words as its retrieval
  task (`data.retrieval.task=passkey_text`, never mixed into training: rate 0) where the tokenizer has the single
  digits, so `sinklab measure OUT`, every evaluation (`eval retrieval` too), and `sinklab-train init_from=OUT`
  (continued pretraining, a retrofit) read it as they read a run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from sinklab import __version__
from sinklab.data.retrieval import digit_ids
from sinklab.errors import UserError
from sinklab.export.llama import LLAMA_NAMES, TOLERANCE, ParityError, new_out_dir
from sinklab.model import ModelConfig, Transformer

IMPORTED_FROM = "sinklab_imported_from"  # a checkpoint's key: where imported weights came from
FAMILIES = ("llama",)  # transformers' model_type values whose every config sinklab checks and maps here


def unsupported(hf_cfg: Any) -> list[str]:
    """What sinklab's Transformer cannot represent of a transformers config, as 'key=value (sinklab needs ...)'."""
    found = []
    model_type = getattr(hf_cfg, "model_type", None)
    if model_type not in FAMILIES:
        return [f"model_type={model_type} (sinklab imports the LLaMA family: {', '.join(FAMILIES)}; "
                "measure any family with --hf-model instead)"]
    rope = getattr(hf_cfg, "rope_parameters", None) or getattr(hf_cfg, "rope_scaling", None) or {}
    checks = (("hidden_act", getattr(hf_cfg, "hidden_act", "silu") == "silu", "silu (SwiGLU)"),
              ("attention_bias", not getattr(hf_cfg, "attention_bias", False), "false"),
              ("mlp_bias", not getattr(hf_cfg, "mlp_bias", False), "false"),
              ("rope_type", rope.get("rope_type", rope.get("type", "default")) == "default",
               "default (unscaled RoPE)"),
              ("pretraining_tp", getattr(hf_cfg, "pretraining_tp", 1) in (None, 1), "1"))
    shown = {"rope_type": rope.get("rope_type", rope.get("type"))}
    found += [f"{key}={shown.get(key, getattr(hf_cfg, key, None))} (sinklab needs {need})"
              for key, ok, need in checks if not ok]
    return found


def rope_base(hf_cfg: Any) -> float:
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))


def model_config(hf_cfg: Any, vocab_size: int) -> ModelConfig:
    """The sinklab ModelConfig of a supported transformers config (`unsupported` empty)."""
    d, heads = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or d // heads
    return ModelConfig(vocab_size=vocab_size, n_layer=hf_cfg.num_hidden_layers, n_head=heads,
                       n_kv_head=getattr(hf_cfg, "num_key_value_heads", None) or heads, d_model=d,
                       head_dim=None if head_dim * heads == d else head_dim, d_ff=hf_cfg.intermediate_size,
                       block_size=hf_cfg.max_position_embeddings, norm_eps=shortest(hf_cfg.rms_norm_eps),
                       rope_base=shortest(rope_base(hf_cfg)),
                       tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)))


def shortest(value: float) -> float:
    """A float read from a float32 field (a GGUF's 1e-5 is 9.999999747378752e-06) as the shortest decimal that is the
    same float32, so the imported config reads as written and equals a preset's (model=smollm2_135m)."""
    return float(f"{float(value):.7g}")


def sinklab_state_dict(hf_state: dict[str, torch.Tensor], n_layer: int, tied: bool) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> sinklab's (the inverse of `LLAMA_NAMES`); rotary buffers are dropped, a tied
    output head is the embedding."""
    names = {theirs: ours for ours, theirs in LLAMA_NAMES(n_layer).items()}
    state = {names[k]: v for k, v in hf_state.items() if k in names}
    if tied:
        state["lm_head.weight"] = state["tok_emb.weight"]
    missing = sorted(set(names.values()) - set(state))
    odd = sorted(k for k in hf_state if k not in names and "rotary_emb" not in k)
    if missing or odd:
        raise UserError(f"the model's weights are not a LLaMA's: {'missing ' + ', '.join(missing[:4]) if missing else ''}"
                        f"{'; unknown ' + ', '.join(odd[:4]) if odd else ''}")
    return state


def import_hf(src: str, out_dir: str, revision: Optional[str] = None, check: bool = True, log=print) -> dict:
    """Write OUT_DIR (see the module docstring); returns {"out_dir", "model", "max_abs_diff", "source"}."""
    from omegaconf import OmegaConf

    from sinklab.io import atomic_write, atomic_write_json
    from sinklab.targets.transformers_lm import load_hf_model, load_hf_tokenizer

    out = new_out_dir(out_dir)
    hf = load_hf_model(src, dtype=torch.float32, revision=revision)
    problems = unsupported(hf.config)
    if problems:
        raise UserError(f"SRC {src}: sinklab's model cannot represent {'; '.join(problems)}")
    tok = load_hf_tokenizer(src, revision)
    vocab = int(hf.get_input_embeddings().num_embeddings)
    cfg = model_config(hf.config, vocab)
    model = Transformer(cfg).eval()
    model.load_state_dict(sinklab_state_dict(hf.state_dict(), cfg.n_layer, cfg.tie_embeddings))
    diff, diff32 = parity(model, hf, vocab) if check else (None, None)
    if diff is not None and diff > TOLERANCE:
        raise ParityError(f"SRC {src}: the imported model's logits differ from transformers' by {diff:.3g} > "
                          f"{TOLERANCE} (float64, random tokens); nothing written")
    source = {"source": str(src), "revision": revision, "class": type(hf).__name__,
              "quantization": getattr(hf.config, "sinklab_gguf_quantization", None), "sinklab_version": __version__}
    data = data_settings(out, tok)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    ckpt = {"state_dict": {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
            "hyper_parameters": {"model": cfg.to_dict(), "optim": {}, "max_steps": 0}, "global_step": 0,
            "datamodule_hyper_parameters": {k: v for k, v in data.items() if k != "_target_"}, IMPORTED_FROM: source}
    atomic_write(out / "checkpoints" / "last.ckpt", lambda f: torch.save(ckpt, f))
    run_config = {"model": cfg.to_dict(), "data": data, "seed": 0, "imported_from": source}
    atomic_write(out / ".hydra" / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(run_config)))
    atomic_write_json(out / "imported_from.json", source)
    log(f"imported {type(hf).__name__} ({cfg.n_layer} layers, {cfg.n_head} / {cfg.kv_heads} heads, d {cfg.d_model}, "
        f"vocabulary {vocab}{', tied embeddings' if cfg.tie_embeddings else ''}) from {src} into {out}")
    if diff is not None:
        log(f"check: max |logit difference| vs transformers = {diff:.3g} in float64 (<= {TOLERANCE}; in float32 "
            f"{diff32:.3g}, the kernels' rounding besides)")
    return {"out_dir": str(out), "model": cfg.to_dict(), "max_abs_diff": diff, "source": source}


def data_settings(out: Path, tok) -> dict:
    """The run config's data section: the default corpus through the model's own tokenizer, its BOS token first (the
    token the model was trained to see first; EOS where it has none)."""
    first = tok.bos_token or tok.eos_token
    settings = {"_target_": "sinklab.data.LMDataModule", "tokenizer": str((out / "tokenizer.json").absolute()),
                "block_size": 64, "probe_seq_len": 64}
    if first is not None:
        settings.update(bos=True, probe_bos=True, eos_token=str(first))
    try:  # the check the data module makes of a passkey task's tokenizer
        digit_ids(tok.backend_tokenizer, "the model's tokenizer")
    except UserError:
        return settings  # no single-digit tokens: no passkey
    settings["retrieval"] = {"task": "passkey_text", "rate": 0.0}  # `sinklab eval retrieval OUT`: the passkey in words
    return settings


@torch.no_grad()
def parity(model: Transformer, hf, vocab: int, seed: int = 0) -> tuple[float, float]:
    """max |logit difference| between sinklab's model and transformers' on 2 random sequences of 32 tokens, in float64
    (what is left: transformers makes its RoPE tables in float32 whatever the model's dtype; 3.0e-5 to 4.8e-5 on
    SmolLM2 by kernel set) and in float32 (the kernels' rounding besides, over 30 layers: 5.6e-5 to 8.6e-5 on SmolLM2
    by kernel set and threads, too near 1e-4 to be the check on another CPU). Both models are cast back to float32
    (exact: every float32 is a float64)."""
    idx = torch.randint(0, vocab, (2, min(32, model.cfg.block_size)), generator=torch.Generator().manual_seed(seed))
    fp32 = float((model(idx) - hf(input_ids=idx).logits).abs().max())
    try:
        fp64 = float((model.double()(idx) - hf.double()(input_ids=idx).logits).abs().max())
    finally:
        model.float(), hf.float()
    return fp64, fp32
