import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from sinklab.model import ModelConfig, Transformer  # noqa: E402

SMALL = dict(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24)


@pytest.fixture
def make_model():
    def make(**overrides):
        torch.manual_seed(0)
        return Transformer(ModelConfig(**{**SMALL, **overrides})).eval()

    return make
