"""The passkey in words, for pretrained models: `data.retrieval.task=passkey_text`.

  passkey_text  [BOS] filler ... "The pass key is d1..dk. Remember it." filler ... "What is the pass key? The pass key
                is" d1..dk [filler ...]

The passkey test of Mohtashami & Jaggi (Landmark Attention, arXiv 2305.16300) as a pretrained model reads it: the key
and the question are sentences through the model's own tokenizer (`KEY_TEXT`, `AFTER_KEY_TEXT`, `QUERY_TEXT`)
instead of the two dedicated marker ids of `passkey`, which a model not trained on them cannot know, so no id is added
to the vocabulary. The knobs are passkey's (`key_len`, `depth`, `query_at`), the digits the tokenizer's single
characters "0".."9" (each key digit one token, as the tokenizers of LLaMA and SmolLM2 split numbers), the answer the k
digits after the question. `ask` is the question's first token, so prefill-then-ask reads the whole question after
the cache is compressed.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from sinklab.config.schema import not_allowed

from .base import TASKS, RetrievalConfig, digit_ids
from .tasks import Passkey

KEY_TEXT = " The pass key is "
AFTER_KEY_TEXT = ". Remember it. "
QUERY_TEXT = " What is the pass key? The pass key is "
MAX_PHRASE = 24  # tokens a tokenizer may take for all three phrases, for `too_long` (which has no tokenizer)


@TASKS.register("passkey_text")
class TextPasskey(Passkey):
    """[BOS] filler KEY_TEXT d1..dk AFTER_KEY_TEXT filler QUERY_TEXT d1..dk [filler]; no dedicated ids."""

    EXTRA_IDS = 0

    def __init__(self, vocab: int, digit_ids: Sequence[int], phrases: Sequence[Sequence[int]],
                 bos_id: Optional[int] = None, reserved: Sequence[int] = (), **knobs: Any):
        super().__init__(vocab, digit_ids, bos_id, reserved, **knobs)
        self.key_text, self.after_key, self.query_text = (np.asarray(p, dtype=np.int64) for p in phrases)  # sample()

    @property
    def n_ids(self) -> int:
        return self.vocab

    @classmethod
    def for_data(cls, config, tokenizer, where, vocab, eos_id, bos_id, new_id) -> "TextPasskey":
        phrases = [tokenizer.encode(text, add_special_tokens=False).ids
                   for text in (KEY_TEXT, AFTER_KEY_TEXT, QUERY_TEXT)]
        return cls(vocab, digit_ids(tokenizer, where), phrases, bos_id, (eos_id,),
                   **{k: getattr(config, k) for k in cls.KNOBS})

    @classmethod
    def too_long(cls, config: RetrievalConfig, length: int, bos: bool) -> Optional[str]:
        need = int(bos) + MAX_PHRASE + 2 * config.key_len
        if need <= length:
            return None
        return not_allowed("data.retrieval.key_len", config.key_len,
                           f"an integer <= {(length - int(bos) - MAX_PHRASE) // 2}",
                           f"(a passkey_text sample needs about {need} tokens: its sentences and the key twice)")

    def describe(self) -> dict:
        return {"task": self.name, **self.knobs, "chance": self.chance(), "key_text": KEY_TEXT,
                "query_text": QUERY_TEXT}
