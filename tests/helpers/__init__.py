"""Helpers shared by the tests (fixtures live in tests/conftest.py): `from tests.helpers import small_model`."""
from .cli import HYDRA_SCHEMA_WARNING, README, REPO, readme_cli_lines, readme_commands, run_sinklab
from .models import (SMALL, assert_same_logits_and_grads, case_id, component_cases, covering, explicit_logits,
                     layer_records, logits_and_grads, refused, save_ckpt, small_model, token_ids, training_peak)
from .hf_models import ABSOLUTE_KINDS, HF_KINDS, MHA_KINDS, hub_cache, tiny_hf, tiny_tokenizer
from .runs import FAST, data_args, natural_run, rows, series, small, train, train_here, write_corpus
from .text import VERSE, WORDS, bpe_corpus, fake_text

__all__ = ["ABSOLUTE_KINDS", "FAST", "HF_KINDS", "HYDRA_SCHEMA_WARNING", "MHA_KINDS", "README", "REPO", "SMALL",
           "VERSE", "WORDS",
           "assert_same_logits_and_grads", "bpe_corpus", "case_id", "component_cases", "covering", "data_args",
           "explicit_logits",
           "fake_text", "hub_cache", "layer_records", "logits_and_grads", "natural_run", "readme_cli_lines",
           "readme_commands", "refused", "rows", "run_sinklab", "save_ckpt", "series", "small", "small_model",
           "tiny_hf", "tiny_tokenizer", "token_ids", "train", "train_here", "training_peak", "write_corpus"]
