"""Callbacks: the sink metric during training, and the run's status file."""
from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
import numpy as np
import torch

from sinklab.errors import describe
from sinklab.keys import SINK1, SINK_PREFIX
from sinklab.metrics import METRICS, SinklabRecorder, measure_all
from sinklab.metrics.sink import layer_sink1
from sinklab.runs.status import Status, write_status
from sinklab.train.fault import Preempted


class SinkCallback(L.Callback):
    """Logs every registered metric (`sinklab.metrics.METRICS`, each under the names it declares: the reference
    page of metrics lists them; a metric with its own input, on that input; `activations=false`: the sink metric
    only) on the probe set every `every_n_steps` optimizer steps and at the end of training; a layer x head heatmap
    of alpha_1 at each validation; at the end, the attention atlas of the final model (<run dir>/atlas.html, `write_atlas`;
    `atlas=false`: none). Runs on rank 0 only; its last measurement survives a resume. The allowed values of its
    arguments: sinklab.train.config.SinkCallbackConfig."""

    def __init__(self, every_n_steps: int = 250, k: int = 4, eps: Sequence[float] = (0.3,),
                 activations: bool = True, heatmap: bool = True, batch_size: int = 50, atlas: bool = True):
        self.every_n_steps = every_n_steps
        self.k, self.eps = k, list(eps)
        self.activations, self.heatmap, self.atlas = activations, heatmap, atlas
        self.atlas_path: Optional[Path] = None  # the attention atlas written at the end of training
        self.batch_size = batch_size
        self.last_step = -1
        self.last: dict[str, float] = {}
        self.seconds = 0.0  # time spent measuring, for the benchmark
        self._alpha1: Optional[torch.Tensor] = None  # (L, H) of the last measurement, for the heatmap
        self._alpha1_step = -1  # the step it was measured at

    # ------------------------------------------------------------------ measurement
    def probe(self, trainer: L.Trainer) -> torch.Tensor:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "probe_tokens"):
            raise RuntimeError("SinkCallback needs a datamodule with probe_tokens()")
        return dm.probe_tokens()

    @torch.no_grad()
    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Every registered metric (`sinklab.metrics.METRICS`; the `sink` metric alone with activations=false) on the
        probe set, as the flat scalars each metric logs."""
        t0 = time.perf_counter()
        net = pl_module.net
        with evaluating(net):
            tokens = self.probe(trainer).to(pl_module.device)
            target = SinklabRecorder(net)
            metrics = METRICS.build(target.context(self.eps, self.k), self.names())
            measure_all(target, tokens, metrics, batch_size=self.batch_size)
            out: dict[str, float] = {}
            grid = None  # the heatmap: the first that a metric gives (`Metric.heatmap`: the sink metric's alpha_1)
            for metric in metrics:
                result = metric.result()
                out.update(metric.log(result))
                grid = metric.heatmap(result) if grid is None else grid
        self._alpha1 = grid  # (L, H), for the heatmap
        self._alpha1_step = trainer.global_step
        self.seconds += time.perf_counter() - t0
        return out

    def names(self) -> Optional[list[str]]:
        """The metrics measured: every registered one, or the sink metric alone with activations=false."""
        return None if self.activations else ["sink"]

    @torch.no_grad()
    def write_atlas(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Path:
        """The attention atlas of the final model (`sinklab.analysis.atlas`: every head's map of the first probe
        sequence, the grid coloured by alpha_1 or any per-head value of the metrics measured) as <run dir>/atlas.html,
        which the closing lines link; it costs one more measurement of the probe set."""
        from sinklab.analysis.atlas import Atlas, checkpoint_label, key_labels, measure_frame, write_atlas
        from sinklab.data.tokenizer import decode_each
        from sinklab.targets import SinklabTarget

        run_dir = Path(trainer.default_root_dir)
        tokens = self.probe(trainer)  # (N, T)
        with evaluating(pl_module.net):
            target = SinklabTarget.of_model(pl_module.net, str(run_dir))
            frame = measure_frame(target, tokens, checkpoint_label(trainer.global_step, None, ""), self.names(),
                                  self.eps, self.k, self.batch_size)
        ctx = target.recorder().context()
        texts = decode_each(getattr(trainer.datamodule, "tokenizer", None), tokens[0].tolist())
        keys = key_labels(ctx.n_extra, ctx.slot_names, texts)
        atlas = Atlas(title=str(run_dir), frames=[frame], queries=texts, keys=keys,
                      input=f"the probe set: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens",
                      note=f"the final model; `sinklab atlas {run_dir}` draws the run's kept checkpoints on a slider")
        return write_atlas(atlas, run_dir / "atlas.html")

    def _emit(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            logger.save()  # on disk before a checkpoint can record this step as measured
        self.last, self.last_step = metrics, trainer.global_step

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.last_step:
            return
        metrics = self.measure(trainer, pl_module) if trainer.is_global_zero else {}
        if trainer.is_global_zero:
            self._emit(trainer, metrics)
        self.last_step = trainer.global_step

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        """On a resume at step G, log again what an uninterrupted run logged at step G: the resumed run's metrics.csv
        keeps the rows before G only (sinklab.train.fault.continue_metrics), and the measurement at G is not repeated
        by the loop."""
        step = trainer.global_step
        if step == 0 or not trainer.is_global_zero:
            return
        val_every = trainer.val_check_interval if isinstance(trainer.val_check_interval, int) else 0
        due = step % self.every_n_steps == 0 or (self.heatmap and val_every and step % val_every == 0)
        if not due:
            return
        if self.last_step == step and self.last:
            self._emit(trainer, self.last)
        else:
            self._emit(trainer, self.measure(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.run(trainer, pl_module)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
            if self.atlas:
                self.atlas_path = self.write_atlas(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not (self.heatmap and trainer.is_global_zero) or trainer.sanity_checking:
            return
        step = trainer.global_step
        if self.last_step != step:
            self._emit(trainer, self.measure(trainer, pl_module))
        elif self._alpha1 is None or self._alpha1_step != step:
            # the scalars of this step are logged (e.g. before a resume from a checkpoint without the map):
            # measure again for the map only
            self.measure(trainer, pl_module)
        # self.last: what was logged at this step (just now, or before a resume), so the map's Sink_1 is the metric's
        path = save_heatmap(self._alpha1, Path(trainer.default_root_dir) / "sink_heatmaps", step, self.last)
        log_heatmap(trainer.loggers, path, step)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "last": self.last, "seconds": self.seconds,
                "alpha1": self._alpha1.tolist() if self._alpha1 is not None else None,
                "alpha1_step": self._alpha1_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step, self.last, self.seconds = state["last_step"], state["last"], state.get("seconds", 0.0)
        # checkpoints written before the map was saved have neither: on_validation_end then measures again
        alpha1 = state.get("alpha1")
        self._alpha1 = torch.tensor(alpha1) if alpha1 is not None else None
        self._alpha1_step = state.get("alpha1_step", -1) if alpha1 is not None else -1


@contextlib.contextmanager
def evaluating(net: torch.nn.Module) -> Iterator[None]:
    """Inside, `net` is in eval mode; its mode is put back afterwards."""
    was_training = net.training
    net.eval()
    try:
        yield
    finally:
        net.train(was_training)


def log_heatmap(loggers: Sequence[Any], path: Path, step: int) -> None:
    """The heatmap PNG as a `wandb.Image` (through `WandbLogger.log_image`) for every wandb logger."""
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # lightning without its wandb module: nothing to log to
        return
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(SINK_PREFIX + "alpha1_heatmap", [str(path)], step=step)


def save_heatmap(alpha1: torch.Tensor, out_dir: Path, step: int, logged: dict[str, float]) -> Path:
    """alpha1 (L, H) -> PNG with layers as rows and heads as columns. The title and the row labels are the values
    the sink metric logged at this step (`logged`: sink/sink1, sink/layer<i>/sink1), per sequence then averaged as
    the closing lines print them, not a threshold of this mean map; layers numbered from 0 as in the log keys. The
    title and the row labels are also the PNG's Title and Description text."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    a = alpha1.float().cpu().numpy()
    per_layer = layer_sink1(logged)
    rows = [f"{i}: {per_layer[i]:.1f}%" if i in per_layer else str(i) for i in range(a.shape[0])]
    title = f"alpha_1 at step {step} (Sink_1 = {logged[SINK1]:.2f}%)"
    fig = heatmap_figure(a, rows, title)
    fig.subplots_adjust(**heatmap_margins(*a.shape))
    path = out_dir / f"alpha1_step{step:07d}.png"
    fig.savefig(path, dpi=110, metadata={"Title": title, "Description": "rows: layer: Sink_1 of its heads: "
                                                                        + ", ".join(rows)})
    plt.close(fig)
    return path


def heatmap_figure(a: np.ndarray, rows: Sequence[str], title: str) -> Any:
    """The heatmap's figure: the (L, H) map with its values, the row labels, the title and a colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L_, H = a.shape
    # at least 4.2 x 2.2 in: room for the title and the row axis label of a model with one layer or few heads
    fig, ax = plt.subplots(figsize=(max(4.2, 1.6 + 0.5 * H), max(2.2, 1.0 + 0.4 * L_)))
    im = ax.imshow(a, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for (i, j), v in np.ndenumerate(a):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
    ax.set_xlabel("head")
    ax.set_ylabel("layer: Sink_1 of its heads")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L_), rows)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="alpha_1")
    return fig


@functools.lru_cache(maxsize=16)
def heatmap_margins(L_: int, H: int) -> dict[str, float]:
    """The subplot margins `tight_layout` gives the heatmap of an (L, H) map with its widest labels (every layer at
    100.0%, a seven-digit step), computed once per shape: a tight layout is a second draw of the figure, about half
    of the heatmap's cost, and its result depends on the labels' sizes only, which these bound."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(np.zeros((L_, H)), [f"{L_ - 1}: 100.0%"] * L_, "alpha_1 at step 9999999 (Sink_1 = 100.00%)")
    fig.tight_layout()
    margins = {k: getattr(fig.subplotpars, k) for k in ("left", "right", "bottom", "top", "wspace", "hspace")}
    plt.close(fig)
    return margins


class StepProgressBar(TQDMProgressBar):
    """The training bar counts optimizer steps up to trainer.max_steps: the train loader is endless, so Lightning's
    own bar (batches of an epoch out of an unknown total, "Epoch 0/-2") says nothing about progress."""

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps)
        bar.initial = trainer.global_step  # a resumed run starts where it stopped
        bar.set_description("steps")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is not None and self._should_update(step, bar.total):
            bar.n = step
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))


class StatusFile(L.Callback):
    """Writes status.json in the run dir (sinklab.runs.status): running / completed / failed / preempted, with the error
    and final metrics, so that a sweep report can read the state of every job, even a failed or unfinished one."""

    def __init__(self, path: Optional[str] = None):
        self.path = path

    def write(self, trainer: L.Trainer, status: Status, error: Optional[str] = None,
              final: Optional[dict[str, float]] = None, step: Optional[int] = None) -> None:
        """The whole state from rank 0: `step` defaults to the trainer's, `final` to none."""
        if not trainer.is_global_zero:
            return
        write_status(self.path or Path(trainer.default_root_dir) / "status.json", status, error=error,
                     step=trainer.global_step if step is None else step, final=final or {})

    def on_fit_start(self, trainer, pl_module) -> None:
        self.write(trainer, Status.RUNNING)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        status = Status.PREEMPTED if isinstance(exception, Preempted) else Status.FAILED
        self.write(trainer, status, error=describe(exception))
