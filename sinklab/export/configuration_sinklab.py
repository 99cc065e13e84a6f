"""The transformers configuration of a sinklab model exported by `sinklab export-hf` (a config LLaMA cannot represent).

`sinklab export-hf` copies this file into the export as configuration_sinklab.py; config.json names it in `auto_map`
(AutoConfig), so `AutoConfig.from_pretrained(DIR, trust_remote_code=True)` builds a `SinklabConfig`. It needs
transformers only. It holds:
- `sinklab_model`: sinklab's model config as a dict (`ModelConfig.to_dict()`, the checkpoint's `model` section), from
  which modeling_sinklab.py builds sinklab's own model;
- `sinklab_version`: the sinklab version that wrote the export (modeling_sinklab.py imports sinklab: `pip install
  sinklab==<version>`);
- `sinklab_plugins`: plugin module -> the distribution that provides it ("mypkg==1.2", or null for code on
  PYTHONPATH), for a model with a plugin's component: modeling_sinklab.py imports these modules;
- `sinklab_extra_state`: the model's non-tensor state (`get_extra_state`, e.g. DSA's training step, which says
  whether its warm-up is over), module name -> value, which safetensors cannot hold;
- the sizes transformers and the tools built on it read (vocab_size, hidden_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings), derived from `sinklab_model`.
"""
from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig


class SinklabConfig(PretrainedConfig):
    model_type = "sinklab"

    def __init__(self, sinklab_model: Optional[dict] = None, sinklab_version: Optional[str] = None,
                 sinklab_plugins: Optional[dict] = None, sinklab_extra_state: Optional[dict] = None, **kwargs):
        self.sinklab_model = dict(sinklab_model or {})
        self.sinklab_version = sinklab_version
        self.sinklab_plugins = dict(sinklab_plugins or {})
        self.sinklab_extra_state = dict(sinklab_extra_state or {})
        m = self.sinklab_model
        n_head = m.get("n_head")
        self.vocab_size = m.get("vocab_size")
        self.hidden_size = m.get("d_model")
        self.num_hidden_layers = m.get("n_layer")
        self.num_attention_heads = n_head
        self.num_key_value_heads = m.get("n_kv_head") or n_head
        self.head_dim = m.get("head_dim") or (m["d_model"] // n_head if n_head and m.get("d_model") else None)
        self.max_position_embeddings = m.get("block_size")
        for derived in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings"):
            kwargs.pop(derived, None)  # written to config.json too, but always derived from sinklab_model
        kwargs.setdefault("tie_word_embeddings", False)  # sinklab's LM head is its own matrix
        super().__init__(**kwargs)
