"""Ways to cut a model's output into stream chunks, for the parsers' tests:
a stream must parse exactly as the whole text does, however it is cut."""

from __future__ import annotations

import random
import re
from typing import Iterator

# Special-token-like markers, words, runs of spaces, single other characters:
# roughly how a BPE tokenizer cuts model output.
_TOKEN = re.compile(r"<\|?/?[a-z_]+\|?>|\s+|\w+|[^\w\s]")


def every_chunking(text: str, seed: int = 0) -> Iterator[list[str]]:
    """The whole text; each cut into two at every boundary; one character at
    a time; token-like pieces; and a few random groupings of those tokens."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    tokens = _TOKEN.findall(text)
    assert "".join(tokens) == text
    yield tokens
    rng = random.Random(seed)
    for _ in range(20):
        pieces, i = [], 0
        while i < len(tokens):
            n = rng.randint(1, 4)
            pieces.append("".join(tokens[i:i + n]))
            i += n
        yield pieces
