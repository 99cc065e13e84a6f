"""Exports of sinklab models to other ecosystems: `llama` writes a transformers LlamaForCausalLM directory."""
