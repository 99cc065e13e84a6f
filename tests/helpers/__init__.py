"""Helpers shared by the tests (fixtures live in tests/conftest.py): `from tests.helpers import small_model`."""
from .cli import HYDRA_SCHEMA_WARNING, README, REPO, readme_cli_lines, readme_commands, run_sinklab
from .models import (SMALL, assert_same_logits_and_grads, case_id, component_cases, covering, explicit_logits,
                     layer_records, logits_and_grads, refused, save_ckpt, small_model, token_ids, training_peak)
from .runs import FAST, data_args, natural_run, rows, series, small, tiny_hf, train, train_here, write_corpus
from .text import VERSE, WORDS, fake_text

__all__ = ["FAST", "HYDRA_SCHEMA_WARNING", "README", "REPO", "SMALL", "VERSE", "WORDS", "assert_same_logits_and_grads",
           "case_id", "component_cases", "covering", "data_args", "explicit_logits", "fake_text", "layer_records",
           "logits_and_grads", "natural_run", "readme_cli_lines", "readme_commands", "refused", "rows", "run_sinklab",
           "save_ckpt", "series", "small", "small_model", "tiny_hf", "token_ids", "train", "train_here", "training_peak",
           "write_corpus"]
