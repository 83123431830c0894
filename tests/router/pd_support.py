"""Fake prefill and decode engines of both hand-off protocols, for the router's P/D tests.

:class:`FakePD` serves, on 127.0.0.1 and an OS-chosen port, from a uvicorn thread, the
paths a router's legs use (``/v1/completions``, ``/v1/chat/completions``, ``/generate``)
as a prefill or a decode instance (``role``) would, plus ``/health``, ``/metrics``
(empty) and ``/server_info`` (``disaggregation_mode``, and a prefill's
``disaggregation_bootstrap_port``: :attr:`FakePD.bootstrap_port`). Every request is
recorded (:attr:`FakePD.received`: path, headers, JSON body).

The KV hand-off goes through a :class:`Handoffs` shared by the fakes of one test:

* SGLang: a prefill registers each ``bootstrap_room`` of its body with its
  ``routed_dp_rank``, then answers; a decode waits (at most :attr:`FakePD.wait_s`) until
  every room of its body is registered, checks ``disagg_prefill_dp_rank`` against the
  rank the prefill registered (400 if they differ), then answers.
* vLLM: a prefill leg (``kv_transfer_params.do_remote_decode``) registers a request id
  and answers ``kv_transfer_params`` naming it (none when :attr:`FakePD.share_storage`);
  a decode leg with ``do_remote_prefill`` answers 400 unless that id is registered.

:attr:`FakePD.fault`: ``"status"`` answers 500 at once; ``"hang"`` never answers (the
request waits, bounded by :attr:`FakePD.wait_s`, until the client leaves). A request
whose client left before its answer is counted in :attr:`FakePD.left`.
Answers: a completion (or chat completion, or ``/generate`` object with SGLang's
``meta_info``, ``input_token_logprobs`` included) whose text says which role and rank
answered; with ``"stream": true`` three SSE events, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvevents.wire.server_info import LOCAL_PREFILL_KEY

__all__ = ["FakePD", "Handoffs"]


class Handoffs:
    """Rooms and request ids registered by prefills, for decodes to take (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.rooms: dict[int, int] = {}
        self.requests: dict[str, int] = {}

    def register_rooms(self, rooms: list[int], rank: int) -> None:
        with self._lock:
            for room in rooms:
                self.rooms[room] = rank
            self._lock.notify_all()

    def wait_rooms(self, rooms: list[int], timeout: float) -> dict[int, int] | None:
        """The rank each room was registered with, once all are; None after ``timeout``."""
        with self._lock:
            ok = self._lock.wait_for(lambda: all(r in self.rooms for r in rooms), timeout)
            return {r: self.rooms[r] for r in rooms} if ok else None

    def register_request(self, rank: int) -> str:
        with self._lock:
            request_id = uuid.uuid4().hex
            self.requests[request_id] = rank
            return request_id


def _rooms(value: Any) -> list[int]:
    return value if isinstance(value, list) else [value]


class FakePD:
    """See the module docstring. ``close()`` it (fixtures do)."""

    wait_s = 10.0

    def __init__(self, role: str, handoffs: Handoffs) -> None:
        self.role = role
        self.handoffs = handoffs
        self.received: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.fault: str | None = None
        self.share_storage = False
        self.left = 0
        self.bootstrap_port = 9000 + len(role)
        self.server_info_status = 200
        """What ``/server_info`` answers: 200 with the role, or this status."""
        self.local_prefill = True
        """A decode says it prefills a request sent alone itself, as the simulated engine
        does (False: as an SGLang decode server, which says nothing of it)."""
        app = FastAPI()

        async def serve(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append((request.url.path, dict(request.headers), body))
            if self.fault == "status":
                return JSONResponse({"error": {"message": f"{self.role} broke"}}, status_code=500)
            if self.fault == "hang":
                await self._until_gone(request, self.wait_s)
                return JSONResponse({"error": "hung"}, status_code=504)
            rank = self._rank(request, body)
            refused = await self._handoff(request, body, rank)
            if refused is not None:
                return refused
            path = request.url.path
            if body.get("stream"):
                return StreamingResponse(self._stream(path, rank), media_type="text/event-stream")
            answer = self._answer(path, rank, body)
            if self.role == "prefill" and "kv_transfer_params" in body and not self.share_storage:
                request_id = self.handoffs.register_request(rank)
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [1, 2, 3],
                    "remote_engine_id": "fake-prefill",
                    "remote_host": "127.0.0.1",
                    "remote_port": self.bootstrap_port,
                    "remote_request_id": request_id,
                }
            return JSONResponse(answer)

        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            app.add_api_route(path, serve, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response("", media_type="text/plain; version=0.0.4")

        @app.get("/server_info")
        async def server_info() -> JSONResponse:
            if self.server_info_status != 200:
                return JSONResponse({"detail": "no"}, status_code=self.server_info_status)
            info: dict[str, Any] = {"disaggregation_mode": self.role}
            if self.role == "prefill":
                info["disaggregation_bootstrap_port"] = self.bootstrap_port
            elif self.local_prefill:
                info[LOCAL_PREFILL_KEY] = True
            return JSONResponse(info)

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise AssertionError("the fake P/D engine did not start within 20 s")
            time.sleep(0.01)

    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        return [body for p, _, body in self.received if path is None or p == path]

    def _rank(self, request: Request, body: dict[str, Any]) -> int:
        header = request.headers.get("x-data-parallel-rank")
        if header is not None:
            return int(header)
        return int(body.get("routed_dp_rank", 0))

    async def _handoff(self, request: Request, body: dict[str, Any], rank: int) -> Response | None:
        room = body.get("bootstrap_room")
        params = body.get("kv_transfer_params")
        if self.role == "prefill" and room is not None:
            self.handoffs.register_rooms(_rooms(room), rank)
        if self.role == "decode" and room is not None:
            wait = asyncio.ensure_future(
                asyncio.to_thread(self.handoffs.wait_rooms, _rooms(room), self.wait_s)
            )
            gone = asyncio.ensure_future(self._until_gone(request, self.wait_s))
            await asyncio.wait((wait, gone), return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not wait.done():
                return JSONResponse({"error": "the client left"}, status_code=499)
            ranks = await wait
            if ranks is None:
                return JSONResponse({"error": f"room {room} never came"}, status_code=504)
            if set(ranks.values()) != {body.get("disagg_prefill_dp_rank")}:
                message = f"disagg_prefill_dp_rank {body.get('disagg_prefill_dp_rank')} != {ranks}"
                return JSONResponse({"error": message}, status_code=400)
        fetches = isinstance(params, dict) and params.get("do_remote_prefill") is True
        known = fetches and params["remote_request_id"] in self.handoffs.requests
        if self.role == "decode" and fetches and not known:
            return JSONResponse({"error": "unknown remote_request_id"}, status_code=400)
        return None

    async def _until_gone(self, request: Request, timeout: float) -> None:
        """Wait until the client leaves (counted in ``left``), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.left += 1
                return
            await asyncio.sleep(0.02)

    def _answer(self, path: str, rank: int, body: dict[str, Any]) -> dict[str, Any]:
        text = f"{self.role}-{rank}"
        if path == "/generate":
            logprobs = [[-0.5, 1, None]] if self.role == "prefill" else [[-0.25, 2, None]]
            meta = {"prompt_tokens": 4, "cached_tokens": 0, "input_token_logprobs": logprobs}
            return {"text": text, "meta_info": meta}
        usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
        if path == "/v1/chat/completions":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            return {"object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        return {"object": "text_completion", "choices": [choice], "usage": usage}

    async def _stream(self, path: str, rank: int) -> AsyncIterator[bytes]:
        for i in range(3):
            event: dict[str, Any] = {"text": f"{self.role}-{rank}-{i}"}
            if path == "/generate":
                event["meta_info"] = {"input_token_logprobs": [[-0.25, 2, None]] if i == 0 else []}
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
