"""Names of logged metrics shared by training, callbacks, reports and the benchmark, and their physical bounds."""
import math

TRAIN_LOSS = "train/loss"
AUX_PREFIX = "train/aux/"  # a component's auxiliary loss (train/aux/<name>, and train/aux/total), added in training
VAL_LOSS = "val/loss"
VAL_BPB = "val/bpb"  # bits per byte of the validation text, beside val/loss (sinklab.model.lm_loss.bits_per_byte)
RETRIEVAL_ANSWER_LOSS = "val/retrieval/answer_loss"  # nats per answer token of the held-out retrieval samples
RETRIEVAL_ACCURACY = "val/retrieval/accuracy"  # their answer spans predicted exactly (sinklab/data/retrieval/)
SINK1 = "sink/sink1"
ALPHA1 = "sink/alpha1"
SINK1_STAR = "sink/sink1_star"  # Sink_1 of the renormalised map (logged for ops whose rows do not sum to one)
SLOT_BIAS = "sink/slot_bias"  # the share of heads sinking on the attention-bias slot (model.attn_bias=k, kv)
TOKENS_PER_SEC = "perf/tokens_per_sec"
MFU = "perf/mfu"
RUN_FAILED = "run/failed"
SINK_PREFIX = "sink/"
ACT_PREFIX = "act/"


# Physical ranges: the bounds the registered metrics declare for their keys (sinklab/metrics/) use these, and the
# training loop's own names have TRAINING_BOUNDS; `sinklab.metrics.base.bounds(name)` looks a name up in both.
PERCENT = (0.0, 100.0)
NON_NEGATIVE = (0.0, math.inf)
UNIT = (0.0, 1.0)
ANY = (-math.inf, math.inf)
TRAINING_BOUNDS = (
    (r"(^|/)loss$", NON_NEGATIVE),  # cross-entropy in nats
    (r"(^|/)bpb$", NON_NEGATIVE),  # bits per byte
    (r"^val/retrieval/answer_loss$", NON_NEGATIVE),
    (r"^val/retrieval/accuracy$", UNIT),
    (r"^lr-", NON_NEGATIVE),
    (r"^perf/mfu$", UNIT),
    (r"^perf/tokens_per_sec$", NON_NEGATIVE),
    (r"^(step|epoch)$", NON_NEGATIVE),
    (r"^run/failed$", UNIT),
    (r"^train/aux/", ANY),  # a component's auxiliary losses and their total (DSA's KL is >= 0; others may not be)
)
