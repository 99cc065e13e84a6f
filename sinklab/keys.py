"""Names of logged metrics shared by training, callbacks, reports and the benchmark."""

TRAIN_LOSS = "train/loss"
VAL_LOSS = "val/loss"
SINK1 = "sink/sink1"
ALPHA1 = "sink/alpha1"
TOKENS_PER_SEC = "perf/tokens_per_sec"
MFU = "perf/mfu"
RUN_FAILED = "run/failed"
SINK_PREFIX = "sink/"
ACT_PREFIX = "act/"

