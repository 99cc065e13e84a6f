"""Tiny GGUF files written with the gguf package (no llama.cpp): a randomly initialised 2-layer transformers model of a
family that transformers reads from GGUF (qwen2, llama), its tensors under llama.cpp's names (gguf's own name map),
the matrices quantized to Q4_1 (blocks of 32 values: a 4-bit code, a scale and a minimum each), the norms and biases
float32, with a byte-level BPE tokenizer trained on VERSE in the metadata (llama.cpp's `gpt2` tokenizer model)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from .hf_models import SMALL, sharpen
from .text import VERSE

GGUF_KINDS = ("qwen2", "llama")
SPECIALS = ["<|endoftext|>", "<|im_start|>"]  # ids 0 and 1: EOS and BOS
VOCAB = 300  # 256 bytes, the specials, and merges learned on VERSE


def bpe_tokenizer():
    """A byte-level BPE of VOCAB tokens trained on VERSE: (tokens in id order, merges as 'a b')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(VERSE)] * 4, trainer)
    vocab = tok.get_vocab()
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])], merges


def llama_cpp_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """q or k rows in llama.cpp's order (its convert script's `permute`: each head's rotary halves interleaved),
    which transformers' GGUF reader undoes for LLaMA."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf(kind: str, path: Path, seed: int = 0, architecture: str | None = None) -> Path:
    """The family's tiny model (d 32, 2 layers, 4 query heads on 2 kv heads, context 64, vocabulary VOCAB; layer 0's
    q and k sharpened) written to `path` as GGUF with Q4_1 matrices; `architecture` overrides the architecture the
    file states (a name transformers does not read, for its refusal)."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'sinklab[gguf]'")
    import transformers as tf

    assert kind in GGUF_KINDS, kind
    tokens, merges = bpe_tokenizer()
    cfg = dict(SMALL, vocab_size=len(tokens), num_key_value_heads=2, bos_token_id=1, eos_token_id=0)
    torch.manual_seed(seed)
    model = (tf.Qwen2ForCausalLM(tf.Qwen2Config(**cfg)) if kind == "qwen2" else
             tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)))
    sharpen(kind, model)
    arch = gguf.MODEL_ARCH.QWEN2 if kind == "qwen2" else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, SMALL["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), architecture or gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny {kind}")
    writer.add_context_length(SMALL["max_position_embeddings"])
    writer.add_embedding_length(SMALL["hidden_size"])
    writer.add_block_count(SMALL["num_hidden_layers"])
    writer.add_feed_forward_length(SMALL["intermediate_size"])
    writer.add_head_count(SMALL["num_attention_heads"])
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(SMALL["hidden_size"] // SMALL["num_attention_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(model.config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(True)
    for name, param in model.state_dict().items():
        w = param.detach().float().numpy()
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_order(w, SMALL["num_attention_heads"] if "q_proj" in name else 2)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if w.ndim == 2:
            writer.add_tensor(target, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(target, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
