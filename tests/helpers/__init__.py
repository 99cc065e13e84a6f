"""Helpers shared by the tests (fixtures live in tests/conftest.py): `from tests.helpers import small_model`."""
from .cli import (DOCS, HYDRA_SCHEMA_WARNING, README, REPO, assert_one_line_error, doc_code_lines, doc_files,
                  doc_section, error_lines, finish, readme_cli_lines, readme_commands, run_cli, run_cli_in_one_process,
                  start_cli)
from .models import (SMALL, assert_same_logits_and_grads, case_id, component_cases, covering, explicit_logits,
                     layer_records, logits_and_grads, refused, save_ckpt, small_model, token_ids, training_peak)
from .hf_models import ABSOLUTE_KINDS, HF_KINDS, MHA_KINDS, hub_cache, tiny_hf, tiny_tokenizer
from .runs import FAST, data_args, git_checkout, natural_run, rows, series, small, train, write_corpus
from .text import VERSE, WORDS, bpe_corpus, corpus_dm, fake_text

__all__ = ["ABSOLUTE_KINDS", "DOCS", "FAST", "HF_KINDS", "HYDRA_SCHEMA_WARNING", "MHA_KINDS", "README", "REPO", "SMALL",
           "VERSE", "WORDS",
           "assert_one_line_error", "assert_same_logits_and_grads", "bpe_corpus", "case_id", "component_cases",
           "corpus_dm", "covering", "data_args", "doc_code_lines", "doc_files", "doc_section", "error_lines",
           "explicit_logits", "fake_text", "finish", "git_checkout", "hub_cache",
           "layer_records", "logits_and_grads", "natural_run", "readme_cli_lines", "readme_commands", "refused",
           "rows", "run_cli", "run_cli_in_one_process", "save_ckpt", "series", "small", "small_model", "start_cli",
           "tiny_hf", "tiny_tokenizer", "token_ids", "train", "training_peak", "write_corpus"]
