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


# The physical range of every logged metric family, the first pattern that matches a name; a new metric family gets
# its line here (tests/metrics/test_bounds.py fails for a logged name without one).
PERCENT = (0.0, 100.0)
NON_NEGATIVE = (0.0, math.inf)
UNIT = (0.0, 1.0)
ANY = (-math.inf, math.inf)
SILU_MIN = -0.2784645427610738  # min_x x * sigmoid(x), at x = -1.2785 (where 1 + x (1 - sigmoid(x)) = 0)
BOUNDS = (
    (r"^sink/(layer\d+/)?(sink|slot)", PERCENT),  # Sink_k, Sink*_k and slot scores, in %
    (r"^sink/(layer\d+/)?alpha", ANY),  # mean attention on token k: [0, 1] for softmax, unbounded for kernel maps
    (r"^act/(layer\d+/)?cos_", (-1.0, 1.0)),
    (r"^act/(layer\d+/)?(\w+_norm_ratio|massive_(ratio|top|median|channel|token))$", NON_NEGATIVE),
    (r"^act/(layer\d+/)?(resid|attn)_(inf_norm|kurtosis|top_median)$", NON_NEGATIVE),  # Bondarenko's outliers
    (r"^act/resid_sink_channel_share$", UNIT),  # share of layers with the most common top channel
    (r"^act/(layer\d+/)?resid_sink_(top|channel|ratio)$", NON_NEGATIVE),  # H_avg's top channel
    (r"^act/(layer\d+/)?(attn_|ffn_|final_)?norm_min$", NON_NEGATIVE),  # min |weight| of a norm
    (r"^act/(layer\d+/)?first_token_attn$", ANY),  # alpha_1 under Qwen's name: as sink/alpha
    (r"^act/(layer\d+/)?gate_low_share$", UNIT),  # share of gate scores below 0.1
    # mean gate scores: in [0, 1] for model.gate_act=sigmoid, in [SILU_MIN, inf) for silu (the name does not say which)
    (r"^act/(layer\d+/)?gate_(mean|first_token)$", (SILU_MIN, math.inf)),
    (r"(^|/)loss$", NON_NEGATIVE),  # cross-entropy in nats
    (r"^lr-", NON_NEGATIVE),
    (r"^perf/mfu$", UNIT),
    (r"^perf/tokens_per_sec$", NON_NEGATIVE),
    (r"^(step|epoch)$", NON_NEGATIVE),
    (r"^run/failed$", UNIT),
)


def bounds(name: str) -> Optional[tuple[float, float]]:
    """The physical range of a logged metric, None for a name no family covers."""
    return next((b for pattern, b in BOUNDS if re.search(pattern, name)), None)
