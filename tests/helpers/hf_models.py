"""Tiny randomly initialised transformers models of many architectures, a word-level tokenizer for them, and a
huggingface_hub cache layout holding revisions of one (no network anywhere)."""
import hashlib
import os
from pathlib import Path

import pytest
import torch

from .text import VERSE

# every family `sinklab measure / quant / eval --hf-model` is tested on; RoPE families first (eval streaming)
HF_KINDS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "neox", "gpt_oss", "gpt2",
            "opt"]
ABSOLUTE_KINDS = ("gpt2", "opt")  # learned absolute positions: no streaming cache
MHA_KINDS = ("gpt2", "neox", "opt")  # one kv head per query head; the others: 4 query heads share 2 kv heads
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
TWO_LAYERS = ("sliding_attention", "full_attention")  # where a family has layer types: layer 0 sees 8 keys


def build(kind: str, layer_types: tuple = TWO_LAYERS):
    """The family's model with a tiny config: len(layer_types) layers (default 2), d 32, 4 heads, vocabulary 128,
    context 64; `layer_types` for the families that have them (Gemma2/3, gpt-oss: sliding windows of 8)."""
    import transformers as tf

    small = dict(SMALL, num_hidden_layers=len(layer_types))
    gqa = dict(small, num_key_value_heads=2)  # grouped-query attention: 4 query heads share 2 kv heads
    sliding = dict(sliding_window=8, layer_types=list(layer_types))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**gqa))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**gqa, sliding_window=16))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**gqa))  # biases on q, k, v
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**gqa, head_dim=8))  # q_norm / k_norm per head
    if kind == "gemma2":  # logit soft-capping, a sliding and a global layer
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**gqa, head_dim=8, query_pre_attn_scalar=8, **sliding))
    if kind == "gemma3":  # per-layer-type RoPE (local and global bases), q_norm / k_norm
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**gqa, head_dim=8, query_pre_attn_scalar=8, **sliding))
    if kind == "olmo2":  # q_norm / k_norm over the whole projection
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**gqa, eos_token_id=1, pad_token_id=0))
    if kind == "phi3":  # fused qkv_proj, RoPE on half of each head
        return tf.Phi3ForCausalLM(tf.Phi3Config(**gqa, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1,
                                                bos_token_id=0))
    if kind == "neox":  # RoPE on half of each head (partial rotary)
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, rotary_pct=0.5))
    if kind == "gpt_oss":  # learned sink logits, mixture of experts, YaRN RoPE, a sliding and a global layer
        return tf.GptOssForCausalLM(tf.GptOssConfig(**gqa, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                                    **sliding))
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=len(layer_types), n_head=4,
                                                n_positions=64, bos_token_id=0, eos_token_id=0))
    if kind == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64,
                                              num_hidden_layers=len(layer_types), num_attention_heads=4,
                                              max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0,
                                              eos_token_id=1, pad_token_id=2))
    raise ValueError(f"unknown kind {kind!r}; allowed: {', '.join(HF_KINDS)}")


@torch.no_grad()
def sharpen(kind: str, model) -> None:
    """Layer 0's queries and keys scaled up (x 8) for sharper, head-dependent maps than the near-uniform random init;
    where a norm follows the projections (q_norm / k_norm), the norm's scale."""
    layer = (model.transformer.h if kind == "gpt2" else model.gpt_neox.layers if kind == "neox" else
             model.model.decoder.layers if kind == "opt" else model.model.layers)[0]
    attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None) or layer.attn
    if kind == "gpt2":
        attn.c_attn.weight[:, :64].mul_(8.0)  # the q and k columns
    elif kind == "neox":
        attn.query_key_value.weight.mul_(8.0)
    elif kind == "phi3":
        attn.qkv_proj.weight[:64].mul_(8.0)  # q (32 rows) and k (2 kv heads x 8: 16 rows), then v
    elif hasattr(attn, "q_norm"):
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.add_(7.0) if kind == "gemma3" else norm.weight.mul_(8.0)  # Gemma scales by 1 + weight
    else:
        attn.q_proj.weight.mul_(8.0)
        attn.k_proj.weight.mul_(8.0)


def tiny_tokenizer(path: Path, bos: bool = True):
    """A word-level tokenizer over VERSE's words (+ <s>, </s>, <unk>, <pad>: ids 0-3), saved to `path`; with `bos`
    it puts <s> before every text, as LLaMA's does."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", "<pad>", *dict.fromkeys(VERSE)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast


def tiny_hf(kind: str, path: Path, seed: int = 0, tokenizer: bool = False) -> Path:
    """A randomly initialised 2-layer model of the family (`build`, `sharpen`), saved with save_pretrained (with
    `tiny_tokenizer` beside it if asked)."""
    pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = build(kind)
    sharpen(kind, model)
    model.save_pretrained(str(path))
    if tokenizer:
        tiny_tokenizer(path, bos=kind not in ABSOLUTE_KINDS)
    return path


def hub_cache(cache: Path, repo_id: str, revisions: dict[str, Path]) -> dict[str, str]:
    """huggingface_hub's cache layout for the model `repo_id` under `cache` (what HF_HUB_CACHE points at):
    models--ORG--NAME/blobs/<sha256 of each file>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, and
    refs/<branch> holding the commit, one per item of `revisions` (branch -> a saved model dir). The commits
    (40 hex digits, from the branch name); returns {branch: commit}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commits = {}
    for branch, src in revisions.items():
        commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
        snap = repo / "snapshots" / commit
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snap / f.relative_to(src)
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, link.parent), link)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
        commits[branch] = commit
    return commits
