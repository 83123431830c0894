"""A fake OpenAI-style engine for router tests: real HTTP, records what it receives.

:class:`FakeEngine` serves, on 127.0.0.1 and an OS-chosen port, from a uvicorn thread:

* ``POST /v1/completions``: records ``(headers, raw body)``; answers a completion whose
  ``usage.prompt_tokens_details.cached_tokens`` is :attr:`FakeEngine.cached_tokens`.
  A body with ``delay_s`` is answered that many seconds late; one with ``fail_status``
  answers that status with an error (and ``retry_after``: that ``Retry-After`` header). With ``"stream": true``
  it sends :attr:`FakeEngine.chunks` SSE chunks ``data: {"i": n}``,
  then ``data: [DONE]``; after the first chunk it waits (at most 20 s) until the test
  calls :meth:`FakeEngine.release`, so a test can prove chunks are relayed as they come.
* ``POST /v1/chat/completions``: recorded in the same list; answers a
  ``chat.completion`` with the same usage.
* ``POST /tokenize``: words ``wN`` -> token id N (vLLM's request/answer shape); recorded.
  With ``messages`` (vLLM's chat form) the words of every message's content, then
  token 1 unless ``add_generation_prompt`` is false; a message whose content is
  ``"refuse"`` answers 400, as vLLM does for a conversation it cannot render.
* ``GET /health``: 200.
* ``GET /v1/models``: :attr:`FakeEngine.models` as vLLM answers it (404 while None, the
  default).
* ``GET /kv_event_sources``: :attr:`FakeEngine.kv_sources` as vLLM answers it (404
  while None, the default).
* ``GET /metrics``: vLLM's scheduler gauges, ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` per ``engine`` (rank), from :attr:`FakeEngine.running`
  and :attr:`FakeEngine.waiting` (zero unless a test sets them), and
  ``vllm:cache_config_info`` per rank of :attr:`FakeEngine.block_sizes`; a test may set
  :attr:`FakeEngine.metrics_status` to make it fail.

:class:`RankPublishers` publishes, like a data-parallel engine, one real
:class:`~kvevents.ZmqEventPublisher` per rank on base + rank (replay on its own range).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvevents import BlockStored, KVEventBatch, ZmqEventPublisher

__all__ = ["FakeEngine", "RankPublishers"]


class FakeEngine:
    """See the module docstring. ``close()`` it (fixtures do)."""

    chunks = 5
    cached_tokens = 7

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.running = {0: 0, 1: 0}
        self.waiting = {0: 0, 1: 0}
        self.metrics_status = 200
        self.block_sizes: dict[int, int] = {}
        """Per rank, the block size ``vllm:cache_config_info`` states (none while empty)."""
        self.kv_sources: dict[str, Any] | None = None
        self.models: dict[str, Any] | None = None
        self._release = threading.Event()
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            raw = await request.body()
            self.received.append((dict(request.headers), raw))
            body = json.loads(raw)
            if "delay_s" in body:
                await asyncio.sleep(body["delay_s"])
            if "fail_status" in body:
                error = {"error": {"message": "asked to fail", "code": body["fail_status"]}}
                retry = {"retry-after": str(body["retry_after"])} if "retry_after" in body else {}
                return JSONResponse(error, status_code=body["fail_status"], headers=retry)
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            usage = {
                "prompt_tokens": 10,
                "completion_tokens": 1,
                "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
            return JSONResponse({"object": "text_completion", "choices": [], "usage": usage})

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            raw = await request.body()
            self.received.append((dict(request.headers), raw))
            usage = {
                "prompt_tokens": 10,
                "completion_tokens": 1,
                "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
            message = {"role": "assistant", "content": "w5"}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            return JSONResponse({"object": "chat.completion", "choices": [choice], "usage": usage})

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            body = json.loads(await request.body())
            self.tokenized.append(body)
            if "messages" not in body:
                return JSONResponse({"tokens": [int(w[1:]) for w in body["prompt"].split()]})
            contents = [m["content"] for m in body["messages"]]
            if "refuse" in contents:
                error = {"message": "cannot render this conversation", "code": 400}
                return JSONResponse({"error": error}, status_code=400)
            tokens = [int(w[1:]) for text in contents for w in text.split()]
            if body.get("add_generation_prompt", True):
                tokens.append(1)
            return JSONResponse({"tokens": tokens})

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def v1_models() -> Response:
            if self.models is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse(self.models)

        @app.get("/kv_event_sources")
        async def kv_event_sources() -> Response:
            if self.kv_sources is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse(self.kv_sources)

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics_status != 200:
                return Response("metrics are broken", status_code=self.metrics_status)
            lines = []
            for name, values in (
                ("vllm:num_requests_running", self.running),
                ("vllm:num_requests_waiting", self.waiting),
            ):
                lines += [f"# HELP {name} Requests.", f"# TYPE {name} gauge"]
                lines += [
                    f'{name}{{engine="{rank}",model_name="tiny"}} {float(n)}'
                    for rank, n in values.items()
                ]
            if self.block_sizes:  # some of vLLM 0.32's labels, as it writes them
                name = "vllm:cache_config_info"
                lines += [f"# HELP {name} Information of the LLMEngine CacheConfig"]
                lines += [f"# TYPE {name} gauge"]
                lines += [
                    f'{name}{{block_size="{size}",effective_attention_block_size="{size}",'
                    f'engine="{rank}",hash_block_size="None",mamba_block_size="None"}} 1.0'
                    for rank, size in self.block_sizes.items()
                ]
            return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)  # off the main thread: no signal handlers
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise AssertionError("the fake engine did not start within 20 s")
            time.sleep(0.01)

    async def _stream(self) -> AsyncIterator[bytes]:
        for i in range(self.chunks):
            yield f"data: {json.dumps({'i': i})}\n\n".encode()
            if i == 0:
                released = await asyncio.to_thread(self._release.wait, 20.0)
                assert released, "the test never released the stream"
        yield b"data: [DONE]\n\n"

    def release(self) -> None:
        """Let a held stream continue past its first chunk."""
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


class RankPublishers:
    """One publisher per rank on tcp://127.0.0.1:live_base + r (replay: replay_base + r)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        dp_size: int,
        live_base: int,
        replay_base: int,
        topic: str = "",
    ) -> None:
        self.live = f"tcp://127.0.0.1:{live_base}"
        self.replay = f"tcp://127.0.0.1:{replay_base}"
        self.publishers = [
            ZmqEventPublisher(r, self.live, self.replay, bind=True, topic=topic, context=ctx)
            for r in range(dp_size)
        ]
        self._hash = 1000

    def store(self, rank: int, tokens: list[int], block_size: int) -> None:
        """Publish a BlockStored chain of ``tokens`` (full blocks) from ``rank``."""
        n = len(tokens) // block_size
        hashes = list(range(self._hash, self._hash + n))
        self._hash += n
        event = BlockStored(
            block_hashes=hashes,  # type: ignore[arg-type]
            parent_block_hash=None,
            token_ids=tokens[: n * block_size],
            block_size=block_size,
            lora_id=None,
            medium="GPU",
        )
        batch = KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=rank)
        self.publishers[rank].publish(batch)

    def close(self) -> None:
        for pub in self.publishers:
            pub.shutdown()
