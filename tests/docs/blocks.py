"""The code blocks of the README and docs/, as the documentation tests read them.

A block is runnable when it is a ``bash``/``sh``/``python`` block, or an unlabelled block
whose first line is a shell prompt (``$ command``, followed by what it prints). A runnable
block is run by the test suite (``tests/docs``) unless the line before its fence says why it
cannot be, as an HTML comment that renders as nothing::

    <!-- illustration: starts a server that runs until stopped -->
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "ROOT", "pages", "blocks"]

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_ILLUSTRATION = re.compile(r"<!--\s*illustration:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: the page (relative to the repository), the line of its fence, its
    language, its text, and the reason it is an illustration (None when it runs)."""

    page: str
    line: int
    lang: str
    code: str
    illustration: str | None

    @property
    def transcript(self) -> bool:
        return self.lang == "" and self.code.lstrip().startswith("$ ")

    @property
    def runnable(self) -> bool:
        return self.lang in ("bash", "sh", "python") or self.transcript

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> Iterator[Block]:
    text = page.read_text()
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = _ILLUSTRATION.search(before)
        yield Block(page=str(page.relative_to(ROOT)), line=line, lang=match.group(1),
                    code=match.group(2), illustration=marked.group(1) if marked else None)
