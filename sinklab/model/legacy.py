"""Loading state dicts written before the plug-in redesign (sinklab 0.1): the attention bias, the operation's own
parameters and the positional encoding moved into submodules, so their keys gained a component's name."""
from __future__ import annotations

import re

RENAMES = (
    (re.compile(r"(blocks\.\d+\.attn\.)(k_bias|v_bias|v_out_bias|v_fixed)$"), r"\1attn_bias.\2"),
    (re.compile(r"(blocks\.\d+\.attn\.)(sink_logit|phi\..+)$"), r"\1op.\2"),
    (re.compile(r"^(abs_pos|pos_bias)\."), "pos."),
)


def upgrade_key(key: str) -> str:
    """A Transformer state-dict key (without prefix) of sinklab 0.1 -> today's key; other keys are unchanged."""
    for pattern, repl in RENAMES:
        key = pattern.sub(repl, key)
    return key


def upgrade_state_dict(module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of the Transformer: rename 0.1 keys under `prefix` in place."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + upgrade_key(key[len(prefix):])
        if new != key:
            state_dict[new] = state_dict.pop(key)
