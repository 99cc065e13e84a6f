"""The end of a training run: status.json = completed with the final metrics, and the closing lines for the user.

    done: 1600 steps, val/loss 4.1234, Sink_1 22.92% (alpha_1 0.151)
    sink: 5.5 of 24 heads (mean over the probe sequences) put > 0.3 of their attention on token 1, the BOS token ...
    heatmap of alpha_1 per layer x head: <run dir>/sink_heatmaps/alpha1_step0001600.png
    atlas: <run dir>/atlas.html
    next: ... (a run that removes the sink)
    run dir: <run dir>

The first and last lines are what scripts (and CI) read; the lines between say where the sink is and what to try.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from sinklab.keys import ALPHA1, SINK1, SINK1_STAR, SLOT_BIAS, VAL_LOSS
from sinklab.runs.status import Status

# what to run next: a K bias gives every head a key to sink on other than token 1 (the sink moves to the slot);
# sigmoid attention without row normalisation needs no sink at all (experiments/cpu/RESULTS.md, section 3)
NEXT = ("sinklab-train model/bias=k (a learned key bias takes the sink: Sink_1 falls to ~0, sink/slot_bias rises) or "
        "sinklab-train model/attn=sigmoid (no row normalisation, no sink: sink/sink1_star ~0); "
        "compare runs with `sinklab report`")
def summary(trainer: Any, callbacks: list[Any], out: Path) -> dict[str, Any]:
    """The final metrics (the trainer's and the sink callback's last measurement), status.json = completed, and
    the closing lines on rank 0."""
    from sinklab.metrics.sink import layer_sink1
    from sinklab.train.callbacks import SinkCallback, StatusFile

    final = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    sink = next((c for c in callbacks if isinstance(c, SinkCallback)), None)
    per_layer: dict[int, float] = {}
    if sink is not None:
        final.update({k: v for k, v in sink.last.items() if "/layer" not in k})
        per_layer = layer_sink1(sink.last)
    # with ddp_spawn this process's trainer did not run the loop (global_step 0); a completed fit ran max_steps
    steps = trainer.global_step or trainer.max_steps
    if trainer.is_global_zero:
        status = next((c for c in callbacks if isinstance(c, StatusFile)), None)
        if status is not None:
            status.write(trainer, Status.COMPLETED, final=final, step=steps)
        first = getattr(trainer.datamodule, "first_probe_token", None) if trainer.datamodule is not None else None
        eps = sink.eps[0] if sink is not None else None
        alpha1 = getattr(sink, "_alpha1", None)  # (layers, heads) of the last measurement
        n_heads = alpha1.numel() if alpha1 is not None else None
        atlas = getattr(sink, "atlas_path", None)
        print("\n".join(closing_lines(steps, final, per_layer, first, eps, n_heads, out, atlas)), flush=True)
    return final


def closing_lines(steps: int, final: dict[str, float], per_layer: dict[int, float], first_token: Optional[str],
                  eps: Optional[float], n_heads: Optional[int], out: Path, atlas: Optional[Path] = None) -> list[str]:
    """The lines printed at the end of a run (see the module docstring); `atlas`: the attention atlas written."""
    msg = f"done: {steps} steps"
    if VAL_LOSS in final:
        msg += f", val/loss {final[VAL_LOSS]:.4f}"
    lines = [msg]
    if SINK1 in final:
        lines[0] += f", Sink_1 {final[SINK1]:.2f}% (alpha_1 {final.get(ALPHA1, float('nan')):.3f})"
        sink1 = final[SINK1]
        if SINK1_STAR in final:  # rows do not sum to one: the raw map's shares say little, the renormalised one's do
            lines[0] += f", Sink*_1 {final[SINK1_STAR]:.2f}% (rows renormalised)"
            sink1, per_layer = final[SINK1_STAR], {}  # per-layer values are of the raw map
        lines.append(sink_line(sink1, per_layer, first_token or "token 1", eps, n_heads))
        if SLOT_BIAS in final:
            lines.append(f"bias slot: {final[SLOT_BIAS]:.2f}% of the heads sink on it instead (sink/slot_bias)")
        heatmaps = sorted((out / "sink_heatmaps").glob("alpha1_step*.png"))
        if heatmaps:
            lines.append(f"heatmap of alpha_1 per layer x head: {heatmaps[-1]}")
        if atlas is not None:
            lines.append(f"atlas: {atlas}")
        if sink1 > 0:
            lines.append(f"next: {NEXT}")
    lines.append(f"run dir: {out}")
    return lines


def sink_line(sink1: float, per_layer: dict[int, float], first_token: str, eps: Optional[float],
              n_heads: Optional[int]) -> str:
    """Where the sink is: how many heads (layer x head, averaged over the probe sequences) put more than eps of their
    attention on token 1, and the share of each layer's heads that do (layers 1-indexed)."""
    share = f"> {eps:g}" if eps is not None else "more than eps"
    if sink1 <= 0:
        return (f"sink: none: no head puts {share} of its attention on token 1, {first_token} "
                f"(alpha_1 per head in the heatmap)")
    heads = f"{sink1 / 100 * n_heads:.1f} of {n_heads} heads" if n_heads else f"{sink1:.2f}% of the heads"
    line = f"sink: {heads} (mean over the probe sequences) put {share} of their attention on token 1, {first_token}"
    sinking = sorted((i for i in per_layer if per_layer[i] > 0), key=lambda i: -per_layer[i])
    if sinking:
        line += "; by layer: " + ", ".join(f"layer {i} {per_layer[i]:.1f}% of its heads" for i in sinking)
    return line
