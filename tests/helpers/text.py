"""Deterministic text for the corpora of the data and training tests."""
import random

WORDS = ["".join(random.Random(i).choice("etaoinshrdlucmfwypvbgk") for _ in range(1 + i % 8)) for i in range(300)]

VERSE = ("thou art the king of nothing more than the shadow of a dream that waking sees no morning light "
         "and every word we speak returns as echo to the silent hall where once the music played").split()


def fake_text(seed: int, n_words: int) -> str:
    """Deterministic pseudo-prose with a Zipf-like word distribution (corpora for the data tests)."""
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        line.append(WORDS[min(int(rng.paretovariate(1.0)) - 1, len(WORDS) - 1)] if rng.random() < 0.7
                    else rng.choice(WORDS))
        if rng.random() < 0.12:
            lines.append(" ".join(line).capitalize() + ".")
            line = []
    return "\n".join(lines) + "\n"
