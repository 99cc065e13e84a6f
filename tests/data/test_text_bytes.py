"""The bytes of text token ids decode to (`sinklab.data.tokenizer.text_bytes`), the denominator of bits per byte: a
byte-level tokenizer's bytes are its decoder's, a character cut at a row's edge counts its own bytes, special tokens
none; a tokenizer whose tokens do not decode to UTF-8 is refused in one line naming it."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sinklab.data.tokenizer import EOS_TOKEN, byte_symbols, text_bytes, train_bpe
from tests.helpers import assert_one_line_error

TEXT = "Sinks in naïve café prose — 注意力 ✓, and plain ASCII too.\nA second line."


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe([TEXT * 3, "the quick brown fox jumps over the lazy dog"], 300)


def test_the_byte_alphabet_is_the_byte_level_decoders():
    assert set(byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(byte_symbols().values()) == list(range(256))
    assert byte_symbols()["\u0120"] == ord(" ")  # GPT-2's 'Ġ'


def test_a_byte_level_row_counts_the_bytes_its_decode_gives(bpe):
    ids = bpe.encode(TEXT).ids
    eos = bpe.token_to_id(EOS_TOKEN)
    assert bpe.decode(ids) == TEXT
    assert text_bytes(bpe, [ids, [eos, *ids, eos], [eos]], "t.json", "rows") == [len(TEXT.encode())] * 2 + [0]


def test_a_cut_character_counts_its_own_bytes_where_decode_puts_a_replacement(bpe):
    """Windows of a longer text: every window's bytes are its share of the text's bytes, so the windows of a split
    add up to the text's bytes (decode would count 3 bytes of U+FFFD for each cut piece)."""
    ids = bpe.encode(TEXT).ids
    cuts = [(a, b) for a in range(len(ids)) for b in range(a + 1, len(ids) + 1)]
    counts = text_bytes(bpe, [ids[a:b] for a, b in cuts], "t.json", "rows")
    cut = 0
    for (a, b), n in zip(cuts, counts):
        decoded = bpe.decode(ids[a:b])
        if "\ufffd" in decoded:
            cut += 1
            assert n < len(decoded.encode())
        else:
            assert n == len(decoded.encode())
    assert cut > 0  # the text has characters of several tokens: some windows cut one
    pieces = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    assert sum(text_bytes(bpe, pieces, "t.json", "rows")) == len(TEXT.encode())


def test_a_tokenizer_decoding_through_text_counts_that_texts_bytes():
    words = TEXT.replace(",", " ").replace(".", " ").split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *dict.fromkeys(words)])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ids = tok.encode(" ".join(words)).ids
    assert text_bytes(tok, [ids], "w.json", "rows") == [len(tok.decode(ids).encode())]  # words joined by spaces


def test_tokens_that_do_not_decode_to_utf8_are_refused_in_one_line_naming_the_tokenizer():
    """A ByteLevel decoder over word tokens: 'é' is the byte-level symbol of byte 0xE9, a lead byte that the next
    token's ASCII does not continue."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]", EOS_TOKEN]))
    tok.decoder = decoders.ByteLevel()
    ids = tok.encode("naïve café prose").ids
    with pytest.raises(Exception) as err:
        text_bytes(tok, [ids], "/data/tok/tokenizer.json", "the validation blocks")
    assert_one_line_error(err, "bits per byte", "/data/tok/tokenizer.json", "the validation blocks",
                          "invalid UTF-8")
