"""Names of logged metrics shared by training, callbacks, reports and the benchmark, and their physical bounds."""
import math
import re
from typing import Optional

TRAIN_LOSS = "train/loss"
VAL_LOSS = "val/loss"
SINK1 = "sink/sink1"
ALPHA1 = "sink/alpha1"
SINK1_STAR = "sink/sink1_star"  # Sink_1 of the renormalised map (logged for ops whose rows do not sum to one)
SLOT_BIAS = "sink/slot_bias"  # the share of heads sinking on the attention-bias slot (model.attn_bias=k, kv)
TOKENS_PER_SEC = "perf/tokens_per_sec"
MFU = "perf/mfu"
RUN_FAILED = "run/failed"
SINK_PREFIX = "sink/"
ACT_PREFIX = "act/"


# The physical range of every logged name, the first pattern that matches: the registered metrics' own (each metric
# declares the bounds of its keys, sinklab/metrics/), then the training loop's below. A logged name no pattern covers
# fails tests/metrics/test_bounds.py.
PERCENT = (0.0, 100.0)
NON_NEGATIVE = (0.0, math.inf)
UNIT = (0.0, 1.0)
ANY = (-math.inf, math.inf)
TRAINING_BOUNDS = (
    (r"(^|/)loss$", NON_NEGATIVE),  # cross-entropy in nats
    (r"^lr-", NON_NEGATIVE),
    (r"^perf/mfu$", UNIT),
    (r"^perf/tokens_per_sec$", NON_NEGATIVE),
    (r"^(step|epoch)$", NON_NEGATIVE),
    (r"^run/failed$", UNIT),
)


def all_bounds() -> list[tuple[str, tuple[float, float]]]:
    """The metrics' bounds (importing sinklab.metrics registers sinklab's own), then the training loop's."""
    from sinklab.metrics import METRICS

    return METRICS.bounds() + list(TRAINING_BOUNDS)


def bounds(name: str) -> Optional[tuple[float, float]]:
    """The physical range of a logged metric, None for a name no family covers."""
    return next((b for pattern, b in all_bounds() if re.search(pattern, name)), None)
