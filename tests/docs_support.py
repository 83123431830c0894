"""Reading the documentation as the tests of ``test_docs.py`` need it: the markdown pages,
their fenced code blocks, links and headings (with GitHub's anchor slugs), and the
``kvevents`` command lines of their shell blocks, joined across continuations and split
at ``&&``, ``|`` and ``;``.

Pure text functions, no process or socket: a page that cannot be read this way fails
the test that reads it, naming the page and line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ROOT",
    "Block",
    "Command",
    "Link",
    "code_blocks",
    "commands",
    "doc_pages",
    "links",
    "segments",
    "slugs",
]

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
"""Fenced blocks whose lines are command lines; ``text``, ``toml``, ``python``... are not."""
_FENCE = re.compile(r"^(\s*)```\s*([\w-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
_KVEVENTS = re.compile(r"(^|&&|\|\||[;|&])\s*([A-Za-z_]\w*=\S*\s+)*kvevents\s")
"""Where a command line runs ``kvevents``: at its start or after a separator, past any
``NAME=value`` assignments (not a diagram's or a sentence's mention of it)."""


def doc_pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, the line its first line of code is on, its text."""

    page: Path
    language: str
    line: int
    text: str


def code_blocks(page: Path) -> list[Block]:
    """Every fenced code block of ``page``, in order."""
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    opened: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, start=1):
        fence = _FENCE.match(line)
        if opened is None and fence:
            opened, body = (number + 1, fence.group(2)), []
        elif opened is not None and line.strip() == "```":
            blocks.append(Block(page, opened[1], opened[0], "\n".join(body)))
            opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{page.name}: a code block opened on line {opened[0] - 1} never closes"
    return blocks


def _prose(page: Path) -> Iterator[tuple[int, str]]:
    """``page``'s lines outside code blocks, with their numbers, code spans blanked."""
    inside = False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if _FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            yield number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def slugs(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped
    (letters, digits, ``_``, ``-`` and spaces kept), spaces made ``-``, a repeated slug
    numbered ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    inside = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        heading = None if inside else _HEADING.match(line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(2))  # a link's text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


@dataclass(frozen=True)
class Link:
    """A link of a page's prose: where it is and what it points at."""

    page: Path
    line: int
    target: str


def links(page: Path) -> list[Link]:
    """Every markdown link and image of ``page``'s prose (not in code)."""
    return [
        Link(page, number, match.group(1))
        for number, line in _prose(page)
        for match in _LINK.finditer(line)
    ]


@dataclass(frozen=True)
class Command:
    """One ``kvevents`` command of a shell block: where it is and its arguments."""

    page: Path
    line: int
    text: str
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {self.text}"


def _logical_lines(block: Block) -> Iterator[tuple[int, str, bool]]:
    """The block's command lines, with whether each ends: a trailing backslash continues
    a line, and so does a quote left open (a JSON value written over several lines). A
    line never closed runs to the block's end, and is yielded as not ending."""
    pending: list[str] = []
    start = block.line
    for offset, line in enumerate(block.text.splitlines()):
        if not pending:
            start = block.line + offset
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        try:
            shlex.split("\n".join(pending), comments=True)
        except ValueError:  # an open quote: the value goes on
            continue
        yield start, " ".join(part.strip() for part in pending).strip(), True
        pending = []
    if pending:
        yield start, " ".join(part.strip() for part in pending).strip(), False


def segments(block: Block) -> Iterator[tuple[int, str, list[str]]]:
    """Each simple command of the block's command lines: its line, the whole line's text,
    and its words (``NAME=value`` assignments before it dropped); a line with ``&&``,
    ``|`` or ``;`` gives one per part. Lines left open (diagrams) give none."""
    for line, text, ends in _logical_lines(block):
        if not ends:
            continue
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segment: list[str] = []
        for token in [*lexer, ";"]:
            if token not in _SEPARATORS:
                segment.append(token)
                continue
            while segment and _ASSIGNMENT.match(segment[0]):
                segment.pop(0)
            if segment:
                yield line, text, segment
            segment = []


def commands(page: Path) -> list[Command]:
    """Every ``kvevents ...`` command of ``page``'s shell blocks (after any ``NAME=value``
    assignments, in any segment of a ``&&``/``|``/``;`` list)."""
    found: list[Command] = []
    for block in code_blocks(page):
        if block.language not in SHELL_LANGUAGES:
            continue
        for line, text, ends in _logical_lines(block):
            assert ends or not _KVEVENTS.search(text), (
                f"{block.page.name}:{line}: a kvevents command line never ends"
            )
        found += [
            Command(page, line, text, words[1:])
            for line, text, words in segments(block)
            if words[0] == "kvevents"
        ]
    return found
