"""``kvevents router`` as a user runs it in front of the real vLLM: a subprocess, over HTTP.

The router is started the way the README tells a vLLM user to, with the engine
described by flags only (vLLM has no ``/server_info``)::

    kvevents router --port 0 --engine URL --kv-endpoint tcp://H:P --replay-endpoint tcp://H:R \\
        --dp-size N --topic kv --block-size 32 --engine-kind vllm --tokenizer MODEL_DIR [...]

and everything below talks to it as a client would: ``/query``, ``/v1/completions``
(plain and streaming), ``/workers``, ``/dump``. Given a ``decode`` engine too, it is
``kvevents router --prefill URL ... --decode URL ...`` (disaggregated serving). Its stdout and stderr go to a log file
(never a pipe that could fill up and stall it); the ready line is read from that file
with a deadline. Used by ``tests/real_engines`` and by ``scripts/real_vllm/route_trace.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvevents import Holder, PrefixIndex

READY = "kvevents router ready "
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def words(tokens: Sequence[int]) -> str:
    """The tiny model's text for token ids: word ``wN`` is token ``N`` (see build_tiny_model)."""
    return " ".join(f"w{t}" for t in tokens)


@dataclass(frozen=True)
class Routed:
    """One ``/v1/completions`` answer relayed by the router: its decision and vLLM's usage."""

    status: int
    worker: str
    dp_rank: int
    matched_tokens: int
    prompt_tokens: int
    policy: str
    body: Any  # the JSON answer, or the list of SSE ``data:`` payloads when streaming
    usage: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    """Every header of the answer (lower-case names), the P/D ones included."""

    @property
    def cached_tokens(self) -> int:
        """What vLLM says it served from its prefix cache (``--enable-prompt-tokens-details``)."""
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


class RouterProcess:
    """A ``kvevents router --port 0`` subprocess in front of one vLLM; :meth:`stop` it.

    ``engine``: the vLLM URL; ``engine_args``: the flags describing it (they follow its
    ``--engine``); ``extra``: router options (``--policy``...). ``log``: the file its
    output goes to (kept for the failure message). ``decode``: a decode engine's URL and
    flags, making ``engine`` the ``--prefill`` engine of disaggregated serving.
    """

    def __init__(
        self,
        engine: str,
        engine_args: Sequence[str],
        *extra: str,
        log: Path,
        timeout: float = START_TIMEOUT_S,
        decode: Sequence[str] | None = None,
    ) -> None:
        self.engine = engine.rstrip("/")
        opener = ["--engine"] if decode is None else ["--prefill"]
        pools = [] if decode is None else ["--decode", *decode]
        self.argv = [
            sys.executable,
            "-m",
            "kvevents.cli.main",
            "router",
            "--port",
            "0",
            "--workers",
            "1",
            *opener,
            self.engine,
            *engine_args,
            *pools,
            *extra,
        ]
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        try:
            self.url = self._await_ready(timeout)
        except BaseException:
            self.stop(check=False)
            raise
        self.http = httpx.Client(base_url=self.url, timeout=120.0)

    def _await_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(READY):
                    return line[len(READY) :].strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(
            f"kvevents router not ready within {timeout:.0f} s (exit {self.proc.poll()}): "
            f"{' '.join(self.argv)}\n{self.output()}"
        )

    def output(self, lines: int = 40) -> str:
        """The tail of the router's log."""
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *, check: bool = True) -> int | None:
        """SIGTERM, wait (SIGKILL after a deadline); with ``check``, a non-zero exit fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10.0)
            code = None
        if hasattr(self, "http"):
            self.http.close()
        self._log_file.close()
        if check and code != 0:
            raise AssertionError(f"kvevents router exited {code} on SIGTERM:\n{self.output()}")
        return code

    def alive(self) -> bool:
        return self.proc.poll() is None

    # --- asking it ------------------------------------------------------------------------

    def holder(self, rank: int) -> Holder:
        """The router's holder for vLLM's rank ``rank`` (its worker name is the engine URL)."""
        return Holder(self.engine, rank)

    def query(
        self,
        prompt: Sequence[int] | str,
        *,
        cache_salt: str | None = None,
        worker: str | None = None,
    ) -> dict[int, int]:
        """``POST /query``: per rank of ``worker`` (default: the engine), the tokens of the
        prompt's longest cached prefix."""
        body: dict[str, Any] = (
            {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
        )
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        resp = self.http.post("/query", json=body)
        resp.raise_for_status()
        return {
            m["dp_rank"]: m["matched_tokens"]
            for m in resp.json()["matches"]
            if m["worker"] == (worker or self.engine)
        }

    def wait_holds(
        self,
        rank: int,
        tokens: Sequence[int],
        block_size: int,
        timeout: float,
        *,
        worker: str | None = None,
    ) -> None:
        """Until ``/query`` shows every full block of ``tokens`` on ``rank`` (of ``worker``,
        default the engine), asked with one token more: a match counts only the blocks an
        engine reuses, every one but a block-aligned prompt's last.

        Each rank's events are applied in seq order, so once a block vLLM stored last is
        in, everything the rank published before it is in too (a barrier).
        """
        full = len(tokens) // block_size * block_size
        deadline = time.monotonic() + timeout
        while (seen := self.query([*tokens, 0], worker=worker).get(rank, 0)) != full:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"router /query shows {seen} of {full} tokens on rank {rank} of "
                    f"{worker or self.engine} after "
                    f"{timeout:.0f} s; /workers: {json.dumps(self.workers()['streams'])}"
                )
            time.sleep(0.02)

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int = 1) -> Routed:
        """``POST /v1/chat/completions`` through the router; the decision and vLLM's usage."""
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        resp = self.http.post("/v1/chat/completions", json=body)
        answer: Any = resp.json() if resp.status_code == 200 else resp.text
        return self._routed(resp, answer, answer["usage"] if resp.status_code == 200 else {})

    def complete(
        self,
        prompt: Sequence[int] | str,
        *,
        max_tokens: int = 1,
        stream: bool = False,
        timeout: float = 120.0,
        extra: Mapping[str, Any] | None = None,
    ) -> Routed:
        """``POST /v1/completions`` through the router (``extra``: more members of its
        body); the decision headers and vLLM's usage."""
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            **(extra or {}),
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        with self.http.stream("POST", "/v1/completions", json=body, timeout=timeout) as resp:
            if not stream or resp.status_code != 200:
                resp.read()
                answer: Any = resp.json() if resp.status_code == 200 else resp.text
                usage = answer["usage"] if resp.status_code == 200 else {}
            else:
                answer = [
                    line[len("data:") :].strip()
                    for line in resp.iter_lines()
                    if line.startswith("data:")
                ]
                usage = next(
                    (json.loads(d)["usage"] for d in answer if d != "[DONE]" and '"usage"' in d),
                    {},
                )
        return self._routed(resp, answer, usage)

    @staticmethod
    def _routed(resp: httpx.Response, answer: Any, usage: dict[str, Any]) -> Routed:
        h = resp.headers
        return Routed(
            status=resp.status_code,
            worker=h.get("x-kvevents-worker", ""),
            dp_rank=int(h.get("x-kvevents-dp-rank", "-1")),
            matched_tokens=int(h.get("x-kvevents-matched-tokens", "-1")),
            prompt_tokens=int(h.get("x-kvevents-prompt-tokens", "-1")),
            policy=h.get("x-kvevents-policy", ""),
            body=answer,
            usage=usage or {},
            headers=dict(h),
        )

    def workers(self) -> dict[str, Any]:
        resp = self.http.get("/workers")
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    def streams(self, worker: str | None = None) -> dict[int, dict[str, Any]]:
        """``/workers`` streams of ``worker`` (default: the engine), by rank (status,
        last_seq, resets, lost...)."""
        name = worker or self.engine
        return {s["dp_rank"]: s for s in self.workers()["streams"] if s["worker"] == name}

    def index(self) -> PrefixIndex:
        """The router's whole index, from ``GET /dump``."""
        resp = self.http.get("/dump")
        resp.raise_for_status()
        return PrefixIndex.from_bytes(resp.content)

    def metrics(self) -> str:
        resp = self.http.get("/metrics")
        resp.raise_for_status()
        return resp.text


def vllm_engine_args(
    *,
    kv_endpoint: str,
    replay_endpoint: str | None,
    dp_size: int,
    topic: str,
    block_size: int,
) -> list[str]:
    """The flags that describe a vLLM to ``kvevents router``, after its ``--engine URL``:
    vLLM has no ``/server_info``, so nothing is discovered."""
    args = ["--kv-endpoint", kv_endpoint]
    if replay_endpoint is not None:
        args += ["--replay-endpoint", replay_endpoint]
    args += [
        "--dp-size",
        str(dp_size),
        "--topic",
        topic,
        "--block-size",
        str(block_size),
        "--engine-kind",
        "vllm",
    ]
    return args
