"""A README quickstart run as a user runs it: its ``kvevents`` lines started as real
processes, each on an OS-chosen port (the README's URLs of them mapped to the real ones),
and its ``curl`` lines sent as curl sends them. Every process is stopped by the caller's
``ExitStack``; every wait is bounded (:class:`~process_support.KVEventsProcess`).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import httpx

from docs_support import Block, code_blocks, segments
from kvevents.cli.main import build_parser
from process_support import KVEventsProcess

__all__ = ["quickstart_blocks", "run_quickstart", "send_curl", "set_value", "value_of"]


def set_value(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced by ``value`` (added when absent)."""
    if flag in args:
        at = args.index(flag)
        return [*args[: at + 1], value, *args[at + 2 :]]
    return [*args, flag, value]


def value_of(args: list[str], flag: str, default: str) -> str:
    """``flag``'s value in ``args``, or ``default``."""
    return args[args.index(flag) + 1] if flag in args else default


def quickstart_blocks(readme: Path, heading: str) -> list[Block]:
    """The README's shell blocks under ``## heading`` that start a ``kvevents engine``."""
    lines = readme.read_text().splitlines()
    start = lines.index(f"## {heading}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [
        block
        for block in code_blocks(readme)
        if start < block.line <= end and re.search(r"^kvevents engine ", block.text, re.M)
    ]


def send_curl(words: list[str], urls: dict[str, str]) -> httpx.Response:
    """A ``curl -s URL -d BODY [-H HEADER]`` line sent as curl sends it (a POST with
    curl's form content type), its URL's host and port mapped through ``urls``."""
    body = words[words.index("-d") + 1]
    url = next(w for w in words[1:] if w != body and re.match(r"(https?://)?localhost:", w))
    for written, real in urls.items():
        url = url.replace(written, real)
    url = url if "://" in url else f"http://{url}"
    headers = {"content-type": "application/x-www-form-urlencoded"}
    return httpx.post(url, content=body.encode(), headers=headers, timeout=60.0)


def run_quickstart(
    block: Block, stack: contextlib.ExitStack
) -> tuple[list[httpx.Response], dict[str, str]]:
    """Start the block's engines and router as the processes its lines start (each on an
    OS-chosen port), then send its curl lines: the answers, in order, and the README's
    URLs of the processes mapped to the real ones."""
    urls: dict[str, str] = {}
    answers = []
    for _, _, words in segments(block):
        if words[0] == "curl":
            answers.append(send_curl(words, urls))
            continue
        assert words[0] == "kvevents", words
        command, args = words[1], words[2:]
        port = value_of(args, "--port", str(build_parser(command).parse_args([command]).port))
        args = set_value(args, "--port", "0")
        if "--disaggregation-bootstrap-port" in args:
            args = set_value(args, "--disaggregation-bootstrap-port", "0")
        if command == "router":  # one process, so the answers below see one index
            args = [*(urls.get(a, a) for a in args), "--workers", "1"]
        proc = KVEventsProcess(command, args, timeout=90.0)
        stack.callback(proc.stop, expect=None)
        if command == "engine":
            urls[f"http://127.0.0.1:{port}"] = proc.url
        else:
            urls[f"localhost:{port}"] = proc.url.removeprefix("http://")
    return answers, urls
