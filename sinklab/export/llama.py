"""sinklab export-hf: a sinklab checkpoint -> a Hugging Face directory: `LlamaForCausalLM` where LLaMA can represent the
config, else `SinklabForCausalLM` as remote code (`sinklab.export.remote`).

    sinklab export-hf CKPT_OR_RUN_DIR OUT_DIR [--dtype float32] [--no-check] [--tokenizer PATH | --no-tokenizer]
    python -m sinklab export-hf ...                           (the same; the command is sinklab.cli.export_hf)

Every config that LLaMA can represent (`ModelConfig.llama_mismatches()` is empty: RoPE, pre-RMSNorm, SwiGLU, softmax, causal,
no biases, sinks or gates; grouped-query attention is fine) is written with `save_pretrained` (config.json +
model.safetensors). Every other config (gates, sink logits and tokens, K / V biases, QK-norm, differential / sigmoid /
kernel attention, layer patterns, other positions, sparse operations, per-head norms, plugins' components) is written
as remote code: config.json with `auto_map`, configuration_sinklab.py and modeling_sinklab.py, which run sinklab's own
model, loaded with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` where sinklab is installed
(`sinklab.export.remote` says what is written). Unless --no-check, the export is loaded back with transformers and
compared with the sinklab model on random tokens (max |logit difference| <= 1e-4 in fp32).

For LLaMA, both implementations use RoPE over the whole head in the rotate-half convention (inv_freq = base^(-2i/d),
cos/sin of cat(freqs, freqs), rotate_half(x) = cat(-x2, x1)) and share grouped kv heads as repeat_interleave,
so the weights map one to one:

    tok_emb                 -> model.embed_tokens          blocks.i.attn.{q,k,v,o}_proj -> ...self_attn.{q,k,v,o}_proj
    blocks.i.norm1 / norm2  -> ...input_layernorm / ...post_attention_layernorm
    blocks.i.ffn.w1/w3/w2   -> ...mlp.gate_proj / up_proj / down_proj
    norm                    -> model.norm                  lm_head                      -> lm_head

The tokenizer is exported too when one is found (--tokenizer, tokenizer.json in the run dir, the run's data config
`data.tokenizer` path, or the run's data module); otherwise it is skipped with a note.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from sinklab import __version__
from sinklab.errors import UserError
from sinklab.model import ModelConfig, Transformer
from sinklab.runs.run_data import RUN_CONFIG, load_run_config, run_dir_of

TOLERANCE = 1e-4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ParityError(RuntimeError):
    """The exported model's logits differ from the checkpoint's beyond the tolerance."""


def unrepresentable(cfg: ModelConfig) -> list[str]:
    """The config keys LLaMA cannot represent, as 'model.key=value (LLaMA needs ...)'; empty when exportable. Each
    component says whether LLaMA can represent it (`llama_ok` in sinklab/model/)."""
    return cfg.llama_mismatches()


def LLAMA_NAMES(n_layer: int) -> dict[str, str]:  # noqa: N802  (a table, built per depth)
    """sinklab's weight names -> LlamaForCausalLM's, for a model of `n_layer` layers (export-hf and import-hf)."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    per_layer = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                 "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.k_proj.weight": "self_attn.k_proj.weight",
                 "attn.v_proj.weight": "self_attn.v_proj.weight", "attn.o_proj.weight": "self_attn.o_proj.weight",
                 "ffn.w1.weight": "mlp.gate_proj.weight", "ffn.w3.weight": "mlp.up_proj.weight",
                 "ffn.w2.weight": "mlp.down_proj.weight"}
    for i in range(n_layer):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in per_layer.items()})
    return names


def llama_state_dict(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """sinklab Transformer state dict -> LlamaForCausalLM state dict; unknown or missing keys are errors."""
    names = LLAMA_NAMES(n_layer)
    out = {names[k]: v for k, v in state.items() if k in names}
    unknown = [k for k in state if k not in names]
    if unknown:
        raise UserError(f"the checkpoint has weights LLaMA cannot hold: {', '.join(sorted(unknown)[:8])}"
                        + (" ..." if len(unknown) > 8 else ""))
    if len(out) != len(names):
        raise UserError(f"the checkpoint holds {len(out)} of the {len(names)} weights of a {n_layer}-layer model")
    return out


def llama_config(cfg: ModelConfig, transformers, dtype: torch.dtype, eos_id: Optional[int] = None):
    import inspect

    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_base)}}
            if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters
            else {"rope_theta": float(cfg.rope_base)})
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hd, hidden_act="silu", max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=None, **rope)
    hf_cfg.architectures = ["LlamaForCausalLM"]
    return hf_cfg


# ------------------------------------------------------------------------------------------------ tokenizer
def tokenizer_file(explicit: str) -> Path:
    """--tokenizer: a tokenizer.json, or a dir holding one; one line when there is none."""
    p = Path(explicit)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"--tokenizer {explicit}: no tokenizer.json there")
    return f


def find_tokenizer(ckpt: Path, explicit: Optional[str]):
    """(tokenizers.Tokenizer, where) or (None, why not)."""
    from tokenizers import Tokenizer

    def from_path(p: Path):
        f = p / "tokenizer.json" if p.is_dir() else p
        return (Tokenizer.from_file(str(f)), str(f)) if f.is_file() else (None, None)

    if explicit is not None:
        return from_path(tokenizer_file(explicit))
    run_dir = run_dir_of(ckpt)
    for d in (ckpt.parent, ckpt.parent.parent):
        for p in (d / "tokenizer.json", d / "tokenizer" / "tokenizer.json"):
            if p.is_file():
                return from_path(p)
    if run_dir is None:
        return None, "no run config next to the checkpoint"
    from omegaconf import OmegaConf

    try:
        data = OmegaConf.to_container(load_run_config(run_dir), resolve=True).get("data")
    except Exception as err:  # a config that does not load, or an interpolation of the user's that does not resolve
        return None, f"the run config does not resolve ({type(err).__name__})"
    if not data:
        return None, "the run config has no data section"
    name = data.get("tokenizer")
    if isinstance(name, str) and name != "bpe" and Path(name).exists():
        tok, where = from_path(Path(name))
        if tok is not None:
            return tok, where
    from sinklab.data.config import build_data_module, data_module_class

    data_module_class(data, f"{run_dir / RUN_CONFIG}")  # sinklab's own data module, whatever the file names
    try:  # the data module knows where its (trained, cached) tokenizer lives
        dm = build_data_module(data)
        dm.prepare()
        tok = getattr(dm, "tokenizer", None)
        if tok is not None and hasattr(tok, "to_str"):
            return tok, "the run's data module"
    except Exception as err:
        return None, f"the run's data module could not provide it ({type(err).__name__})"
    return None, "the run's data module has no tokenizer"


def save_tokenizer(tok, out_dir: Path, transformers) -> Optional[int]:
    """Write tokenizer.json + tokenizer_config.json via PreTrainedTokenizerFast; the EOS id if there is one."""
    eos = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    fast.save_pretrained(str(out_dir))
    return tok.token_to_id(eos) if eos is not None else None


# ------------------------------------------------------------------------------------------------ export
def new_out_dir(out_dir: str) -> Path:
    """OUT_DIR, which must not exist or be an empty directory (an export never writes over files)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"OUT_DIR {out_dir}: exists and is not an empty directory; choose a new one")
    return out


def export(ckpt_path: str, out_dir: str, dtype: str = "float32", check: bool = True,
           tokenizer: Optional[str] = None, with_tokenizer: bool = True, log=print) -> dict:
    """Write OUT_DIR; returns {"out_dir", "architecture", "max_abs_diff" (None without check), "tokenizer"}."""
    from sinklab.runs.checkpoints import find_checkpoint, model_config, read_checkpoint

    from . import remote

    if not Path(ckpt_path).exists():
        raise UserError(f"CKPT {ckpt_path}: no such checkpoint or run dir")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: allowed: {', '.join(DTYPES)}")
    out = new_out_dir(out_dir)
    if tokenizer is not None:
        tokenizer_file(tokenizer)  # before the checkpoint is read
    ckpt_file = find_checkpoint(ckpt_path)
    ckpt = read_checkpoint(ckpt_file)
    cfg = model_config(ckpt, ckpt_file)
    bad = unrepresentable(cfg)  # not LLaMA: remote code (sinklab.export.remote)
    plugins = remote.plugin_modules(cfg) if bad else {}  # refuses a component nothing could import, before writing

    from sinklab.targets.hf_common import dtype_kwargs, quiet, require_transformers

    transformers = require_transformers()
    state = {}
    for k, v in ckpt["state_dict"].items():
        if k.startswith("model."):
            state[k[len("model."):].replace("_orig_mod.", "")] = v
    torch_dtype = DTYPES[dtype]
    hf_state = None if bad else {k: v.to(torch_dtype) for k, v in llama_state_dict(state, cfg.n_layer).items()}

    tok, where = (find_tokenizer(ckpt_file, tokenizer) if with_tokenizer or tokenizer else (None, "--no-tokenizer"))
    with quiet(transformers):  # its own lines only: no bar of the writes or of the check's load in between
        out.mkdir(parents=True, exist_ok=True)
        eos_id = save_tokenizer(tok, out, transformers) if tok is not None else None
        if bad:
            remote.write(state, cfg, out, torch_dtype, eos_id, plugins, bad)
            log(f"wrote {out} (SinklabForCausalLM as remote code, {cfg.n_layer} layers, {dtype}): LLaMA cannot "
                f"represent {'; '.join(bad)}; load it with AutoModelForCausalLM.from_pretrained(DIR, "
                f"trust_remote_code=True), which needs sinklab {__version__}"
                + "".join(f" and {p or m + ' on PYTHONPATH'}" for m, p in plugins.items()))
        else:
            hf_cfg = llama_config(cfg, transformers, torch_dtype, eos_id)
            model = transformers.LlamaForCausalLM(hf_cfg).to(torch_dtype)
            result = model.load_state_dict(hf_state, strict=True)
            if getattr(result, "missing_keys", None) or getattr(result, "unexpected_keys", None):
                raise UserError(f"weights do not fit LlamaForCausalLM: {result}")
            model.save_pretrained(str(out))
            log(f"wrote {out} (LlamaForCausalLM, {cfg.n_layer} layers, {cfg.n_head} heads / {cfg.kv_heads} kv heads, "
                f"{dtype})")
        log(f"tokenizer: {'from ' + where if tok is not None else 'skipped: ' + where}")
        diff = None
        if check:
            diff = parity(state, cfg, out, torch_dtype, transformers, dtype_kwargs, remote=bool(bad))
            log(f"check: max |logit difference| vs the sinklab model = {diff:.3g} (tolerance {TOLERANCE:g})")
            if not diff <= TOLERANCE:
                raise ParityError(f"exported model disagrees with the checkpoint: max |logit difference| {diff:.3g} "
                                   f"> {TOLERANCE:g}")
        return {"out_dir": str(out), "architecture": "SinklabForCausalLM" if bad else "LlamaForCausalLM",
                "max_abs_diff": diff, "tokenizer": where if tok is not None else None}


@torch.no_grad()
def parity(state: dict, cfg: ModelConfig, out: Path, torch_dtype, transformers, dtype_kwargs,
           remote: bool = False) -> float:
    """Load OUT_DIR back with transformers in fp32 (`remote`: its remote code, trust_remote_code) and compare logits
    with the sinklab model (its weights rounded to the saved dtype) on random tokens."""
    from . import remote as remote_code

    ours = Transformer(cfg)
    ours.load_state_dict({k: v.to(torch_dtype).float() for k, v in state.items()})
    ours.eval()
    if remote:
        theirs = remote_code.load(out, transformers, dtype_kwargs)
    else:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True,
                                                                   **dtype_kwargs(transformers, torch.float32)).eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (2, min(cfg.block_size, 128)), generator=g)
    a = ours(idx)
    b = theirs(input_ids=idx, use_cache=False).logits
    return (a - b).abs().max().item()
