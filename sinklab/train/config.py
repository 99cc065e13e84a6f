"""Schemas (Hydra structured configs) of the Trainer and of the callbacks sinklab configures.

Each dataclass holds the defaults once and the rules; `conf/trainer/*.yaml` and `conf/callbacks/default.yaml` list
it first in their defaults (`schema`) and hold only what differs. The schemas of Lightning's Trainer and
ModelCheckpoint take every argument of the class (derived from its signature), with sinklab's defaults and rules
first. A value is refused in one line naming the key: a wrong type when the config is composed, a rule when
`validate_config` turns the node into its dataclass.
"""
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, List, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from sinklab.config.schema import (Schema, boolean, choice, either, integer, number, numbers, rule,
                                   with_arguments_of)
from sinklab.config.store import SCHEMA_NAME
from sinklab.errors import UserError

PRECISIONS = ("auto", "64-true", "64", "32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "16-true",
              "bf16-true", "transformer-engine", "transformer-engine-float16")
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGCONT", "SIGHUP")


@dataclass
class TrainerSettings(Schema):
    """trainer: lightning.pytorch.Trainer. The train loader is endless, so training is bounded and validated by
    steps, never epochs; the data module shards batches across ranks itself."""

    KEY = "trainer"
    _target_: str = "lightning.pytorch.Trainer"
    devices: Any = rule(1, either(integer(1), choice("auto", -1), numbers(integer(0), what="device indices")))
    num_nodes: int = rule(1, integer(1))
    # auto: bf16-mixed on a GPU, 32-true on a CPU (bf16 is unusably slow on CPUs); the entry point decides
    precision: Any = rule("auto", choice(*PRECISIONS, 16, 32, 64))
    # the schema default (`~scale`): ~4 minutes for the tiny model on 2 CPU cores; the default run (scale=quick) sets 1600
    max_steps: int = rule(750, integer(1), "(the train loader is endless, so training is bounded by steps)")
    gradient_clip_val: Optional[float] = rule(1.0, number(ge=0, optional=True))
    val_check_interval: int = rule(250, integer(1), "(steps between validations; the train loader is endless)")
    check_val_every_n_epoch: Optional[int] = rule(
        None, choice(None), "(the train loader is endless: use trainer.val_check_interval)")
    limit_val_batches: Any = rule(20, either(integer(0), number(ge=0, le=1)))
    num_sanity_val_steps: int = rule(0, integer(-1))
    log_every_n_steps: int = rule(10, integer(1))
    accumulate_grad_batches: int = rule(1, integer(1))
    enable_progress_bar: Optional[bool] = True
    enable_model_summary: Optional[bool] = True
    use_distributed_sampler: bool = rule(False, choice(False), "(the data module shards batches across ranks itself)")
    deterministic: Any = False


# callbacks and loggers are built from their own groups and passed by the entry point
TrainerConfig = with_arguments_of(Trainer.__init__, TrainerSettings, "TrainerConfig", skip=("callbacks", "logger"))


@dataclass
class LogTokensConfig(Schema):
    """callbacks.checkpoint.keep.log_tokens: keep the model when the tokens seen first reach start * 10^(j /
    per_decade), j = 0, 1, 2, ...: `per_decade` checkpoints per decade of tokens, evenly spaced on a log axis."""

    KEY = "callbacks.checkpoint.keep.log_tokens"
    start: Optional[float] = rule(None, number(gt=0, optional=True), "(tokens seen at the first one; null: off)")
    per_decade: int = rule(4, integer(1))


@dataclass
class KeepConfig(Schema):
    """callbacks.checkpoint.keep: a schedule of checkpoints kept beside last.ckpt (never overwritten, never resumed
    from by ckpt_path=auto), as <dirpath>/kept/step<step>-tokens<tokens seen>.ckpt, for `sinklab trajectory`: every
    `every_n_steps` steps and/or log-spaced in tokens seen (`log_tokens.start`); both set: the union; neither (the
    schema's default): none. `weights_only`: the model's weights and hyper-parameters without the optimizer state
    (a third of the size; enough to measure or load the model, not to resume training from)."""

    KEY = "callbacks.checkpoint.keep"
    every_n_steps: Optional[int] = rule(None, integer(1, optional=True))
    log_tokens: Optional[LogTokensConfig] = field(default_factory=LogTokensConfig)  # off while start is null
    weights_only: bool = rule(True, boolean)

    def __post_init__(self) -> None:
        if isinstance(self.log_tokens, Mapping):  # from Python or a plain config
            self.log_tokens = LogTokensConfig(**self.log_tokens)
        super().__post_init__()

    @property
    def log_start(self) -> Optional[float]:
        """Tokens seen at the first log-spaced checkpoint, None when that schedule is off."""
        return self.log_tokens.start if self.log_tokens is not None else None


@dataclass
class CheckpointSettings(Schema):
    """callbacks.checkpoint: sinklab.train.kept.KeptCheckpoint, Lightning's ModelCheckpoint with a kept schedule;
    `checkpoints/last.ckpt` every `every_n_train_steps` steps (what a resume starts from), no top-k, and the
    checkpoints of `keep` (null: none)."""

    KEY = "callbacks.checkpoint"
    _target_: str = "sinklab.train.kept.KeptCheckpoint"
    keep: Optional[KeepConfig] = field(default_factory=KeepConfig)  # keeps nothing while both schedules are off
    filename: Optional[str] = "step{step:07d}"
    auto_insert_metric_name: bool = False
    save_last: Any = True
    save_top_k: int = 0
    every_n_train_steps: Optional[int] = rule(250, integer(1, optional=True))
    # resuming in a copied or moved run dir still overwrites checkpoints/last.ckpt
    enable_version_counter: bool = False
    save_on_exception: bool = rule(False, choice(False),
                                   "(it would overwrite last.ckpt with the state of a failed step)")


CheckpointConfig = with_arguments_of(ModelCheckpoint.__init__, CheckpointSettings, "CheckpointConfig")


@dataclass
class SinkCallbackConfig(Schema):
    """callbacks.sink: sinklab.train.callbacks.SinkCallback, the sink metric on the probe set during training."""

    KEY = "callbacks.sink"
    _target_: str = "sinklab.train.callbacks.SinkCallback"
    every_n_steps: int = rule(250, integer(1))
    k: int = rule(4, integer(1))
    eps: List[float] = rule([0.3], numbers(number(gt=0, lt=1), what="thresholds in (0, 1)"))
    activations: bool = rule(True, boolean)
    heatmap: bool = rule(True, boolean)
    batch_size: int = rule(50, integer(1))
    atlas: bool = rule(True, boolean)


@dataclass
class PreemptionConfig(Schema):
    """callbacks.preemption: sinklab.train.fault.PreemptionCallback. SIGTERM (pre-emption) and SIGUSR2
    (submitit, before the time limit): save last.ckpt after the current step and stop; submitit requeues."""

    KEY = "callbacks.preemption"
    _target_: str = "sinklab.train.fault.PreemptionCallback"
    signals: List[str] = rule(["SIGTERM", "SIGUSR2"],
                              numbers(choice(*PREEMPTION_SIGNALS), what=f"of {', '.join(PREEMPTION_SIGNALS)}"))

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.signals:
            if not hasattr(signal, name):
                raise UserError(f"{self.KEY}.signals: {name!r} is not a signal on this platform")


@dataclass
class StatusFileConfig(Schema):
    """callbacks.status: sinklab.train.callbacks.StatusFile; path null: <run dir>/status.json."""

    KEY = "callbacks.status"
    _target_: str = "sinklab.train.callbacks.StatusFile"
    path: Optional[str] = None


def register(cs) -> None:
    """Store each schema under its node's group (trainer, callbacks/sink, ...) as `schema`."""
    for schema in (TrainerConfig, CheckpointConfig, SinkCallbackConfig, PreemptionConfig, StatusFileConfig):
        cs.store(group=schema.KEY.replace(".", "/"), name=SCHEMA_NAME, node=schema)
