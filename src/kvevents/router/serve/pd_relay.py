"""The router's relay in disaggregated (P/D) mode: ``/v1/completions``, chat, ``/generate``.

Each request is read (bounded; :mod:`kvevents.router.serve.pd_read`), its prompts
tokenized as in one-pool mode (a batch of prompts, a chat, text or token ids;
``/generate`` takes ``input_ids`` or ``text``, one or a list), routed by
:func:`~kvevents.router.decide.pd.decide_pd` (the decode holder, and the prefill holder
unless the decode can prefill alone), counted on each leg's holder
(:meth:`Router.begin`), and sent:

* prefill skipped: to the decode instance alone, its rank pinned as the protocol pins
  ranks, no hand-off fields;
* ``sglang``: both legs at once, joined by fresh ``bootstrap_room`` values
  (:mod:`kvevents.router.serve.pd_legs`); ``/generate`` with ``return_logprob`` gets
  the prefill's ``input_token_logprobs`` in front of the decode's;
* ``vllm``: the prefill leg, then the decode leg carrying its ``kv_transfer_params``.
  ``/generate`` is SGLang's: with this protocol it answers 501.

The client gets the decode's answer as the engine sent it, streamed as it comes, with
the one-pool relay's decision headers for the decode holder and
``x-kvevents-prefill`` (``skipped``, or why the prefill holder was chosen: ``cache``,
``prediction``, ``load``), ``x-kvevents-prefill-worker``, ``x-kvevents-prefill-dp-rank``
and ``x-kvevents-uncached-tokens``; a ``/generate`` JSON object also gets a ``router``
member saying the same. A leg that fails (:mod:`kvevents.router.serve.pd_exchange`) is
one error for the client, in the route's shape: OpenAI's ``{"error": {...}}`` on
``/v1/*``, ``{"error": message}`` on ``/generate``; 502 for an engine down or failing
(the 4xx of a prefill that refused the body), 504 past a leg's deadline.

A request that asks for no stream is served from uvicorn's parser callbacks
(:meth:`PDRelay.inline_path`, :mod:`kvevents.http.inline`), as the one-pool relay's
completions are: a framework's request cycle costs more than the relay's own work. A
body of one prompt of token ids is read without decoding its prompt, and its legs
(either protocol's) are its bytes with their members appended
(:mod:`kvevents.router.serve.pd_body`); any other body is decoded and each leg encoded
from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvevents.errors import RouterNotReadyError
from kvevents.http.inline import InlineAnswer
from kvevents.http.upstream_answers import Response
from kvevents.router.decide.models import UnknownModelError
from kvevents.router.decide.pd import PDDecision, Pool, decide_pd
from kvevents.router.decide.router import RouteDecision
from kvevents.router.prompts.completion_body import RelayFields
from kvevents.router.serve.bodies import pinned_bytes
from kvevents.router.serve.openai_relay import OpenAIRelay
from kvevents.router.serve.pd_body import (
    sglang_leg_bytes,
    transfer_params,
    vllm_decode_bytes,
    vllm_prefill_bytes,
)
from kvevents.router.serve.pd_exchange import Leg, LegFailed, PDExchange, Whole
from kvevents.router.serve.pd_legs import (
    new_rooms,
    pinned_body,
    sglang_legs,
    vllm_decode_body,
    vllm_prefill_body,
)
from kvevents.router.serve.pd_mode import PDMode
from kvevents.router.serve.pd_read import (
    PDRequest,
    asks_stream,
    generate_request,
    read_request,
    samples_of,
)
from kvevents.router.serve.pd_request import (
    PD_PATHS,
    Endpoint,
    error_answer,
    error_kind,
    generate_answer,
    pd_headers,
)
from kvevents.router.serve.pd_sse import merged_first_event
from kvevents.router.serve.relay_answer import Answer, OpenAIError
from kvevents.router.serve.relay_body import prompts_of
from kvevents.router.serve.relay_headers import (
    RANK_HEADER,
    _engine_headers,
    _forwarded,
    _request_lines,
)
from kvevents.router.serve.relay_stream import UsageTracker
from kvevents.router.serve.request_stats import engine_usage_of_json
from kvevents.router.serve.service import FORWARD_ERRORS, RouterService

__all__ = ["PDRelay"]

_PATHS: Mapping[Endpoint, str] = {endpoint: path for path, endpoint in PD_PATHS.items()}
_ENDPOINTS: Mapping[bytes, Endpoint] = {path.encode(): e for path, e in PD_PATHS.items()}
_RANK_HEADER = RANK_HEADER.encode("latin-1")
_ENCODER = msgspec.json.Encoder()
_JSON = (b"content-type", b"application/json")


class PDRelay(OpenAIRelay):
    """Answers :data:`PD_PATHS` for ``service`` in P/D mode (``pd``)."""

    def __init__(self, service: RouterService, pd: PDMode, *, max_body_bytes: int) -> None:
        super().__init__(service, max_body_bytes=max_body_bytes)
        self.pd = pd
        self._kept: tuple[bytes, PDRequest | dict[str, Any]] | None = None
        """The last body :meth:`inline_path` read and left to the ASGI path (a stream)."""
        self._hosts: dict[str, str] = {}
        """Each prefill engine URL's host (its bootstrap server's), parsed once."""

    def inline(
        self, raw_headers: list[tuple[bytes, bytes]], raw: bytes
    ) -> Awaitable[InlineAnswer] | None:
        """Never through the one-pool hook: P/D requests come in by :meth:`inline_path`."""
        return None

    def inline_path(
        self, path: bytes, raw_headers: list[tuple[bytes, bytes]], raw: bytes
    ) -> Awaitable[InlineAnswer] | None:
        """The answer to come for a request of ``path`` (one of :data:`PD_PATHS`) from
        uvicorn's parser callbacks (:mod:`kvevents.http.inline`), or None to serve it
        as ASGI (:meth:`answer_path`): when it asks for a stream (what was read of it
        is kept for that path), or its body is to be refused (worded there)."""
        endpoint = _ENDPOINTS[path]
        try:
            read = read_request(endpoint, raw)
        except OpenAIError:
            return None
        if asks_stream(endpoint, read):
            self._kept = (raw, read)
            return None
        return self._inline_answer(endpoint, _forwarded(raw_headers), raw, read)

    async def _inline_answer(
        self,
        endpoint: Endpoint,
        headers: dict[bytes, bytes],
        raw: bytes,
        read: PDRequest | dict[str, Any],
    ) -> InlineAnswer:
        try:
            answer = await self._answer(endpoint, headers, raw, read)
        except OpenAIError as exc:
            answer = error_answer(endpoint, exc.status, str(exc), exc.kind, exc.param)
        assert answer.stream is None, "a request that asks for no stream gets none"
        return answer.status, answer.headers, answer.body

    async def answer_path(self, path: str, headers: dict[bytes, bytes], raw: bytes) -> Answer:
        endpoint = PD_PATHS[path]
        try:
            # a stream :meth:`inline_path` read comes here with the same bytes: equal
            # bytes read alike, whichever request sent them
            kept = self._kept
            if kept is not None and kept[0] == raw:
                self._kept = None
                read = kept[1]
            else:
                read = read_request(endpoint, raw)
            return await self._answer(endpoint, headers, raw, read)
        except OpenAIError as exc:
            return error_answer(endpoint, exc.status, str(exc), exc.kind, exc.param)

    async def _answer(
        self,
        endpoint: Endpoint,
        headers: dict[bytes, bytes],
        raw: bytes,
        read: PDRequest | dict[str, Any],
    ) -> Answer:
        request = read if isinstance(read, PDRequest) else await self._request(endpoint, raw, read)
        decision = self._decide(request)
        return await self._serve(request, decision, headers)

    # --- reading and deciding ---

    async def _request(self, endpoint: Endpoint, raw: bytes, body: dict[str, Any]) -> PDRequest:
        """A body decoded whole (:func:`read_request`) read as a request: its prompts
        tokenized."""
        if endpoint == "generate":
            return await generate_request(raw, body, self.service.text_tokenizer)
        samples = samples_of(body.get("n", 1), "n")
        stream = RelayFields.of(body).wants_stream
        if endpoint == "chat":
            prompts: list[Sequence[int]] = [await self._chat_tokens(body)]
            return PDRequest(
                endpoint, raw, body, prompts, batched=False, samples=samples, stream=stream
            )
        given = prompts_of(body)
        prompts = [await self._prompt_tokens(body, p) for p in given]
        batched = isinstance(body["prompt"], list) and isinstance(body["prompt"][0], (str, list))
        return PDRequest(
            endpoint, raw, body, prompts, batched=batched, samples=samples, stream=stream
        )

    def _decide(self, request: PDRequest) -> PDDecision:
        try:
            return decide_pd(
                self.service.router,
                self.pd.pools,
                request.prompts,
                max_local_prefill_tokens=self.pd.max_local_prefill_tokens,
                # vLLM computes the prompt of a request asking for its logprobs itself,
                # whatever it holds or is handed: a prefill leg would be computed twice
                decode_alone=request.prompt_logprobs and self.pd.protocol == "vllm",
                serves_alone=self.pd.serves_alone,
                policy=self.service.policy,
                lora=request.lora,
                cache_salt=request.salt,
                model=request.model,
                extra_keys=request.extra_keys,
            )
        except UnknownModelError as exc:
            raise OpenAIError(404, str(exc), "NotFoundError", "model") from None
        except RouterNotReadyError as exc:
            raise OpenAIError(503, str(exc), "service_unavailable") from None
        except ValueError as exc:  # extra keys that cannot be keyed
            raise OpenAIError(400, f"request body: {exc}") from None

    # --- sending ---

    async def _serve(
        self, request: PDRequest, decision: PDDecision, headers: dict[bytes, bytes]
    ) -> Answer:
        pd, service = self.pd, self.service
        if request.endpoint == "generate" and pd.protocol == "vllm":
            raise OpenAIError(
                501,
                "POST /generate is SGLang's endpoint: with --pd-protocol vllm send "
                "/v1/completions or /v1/chat/completions",
                "not_implemented",
            )
        shown = pd_headers(decision)
        headers[b"accept-encoding"] = b"identity"
        headers[b"content-type"] = b"application/json"
        lines = _request_lines(headers)  # checked before any leg is counted
        router = service.router
        decode = self._leg("decode", decision.decode, request, lines, None)
        prefill = None
        if decision.prefill is not None:
            prefill = self._leg("prefill", decision.prefill, request, lines, pd.prefill_timeout)
        pd.stats.decided(decision)
        loop = asyncio.get_running_loop()
        exchange = PDExchange(
            service.upstream, router, pd.stats, pd.background, decode, prefill, loop=loop
        )
        prefilled: asyncio.Future[Whole | None] | None = None
        try:
            if prefill is None:
                decode.content = self._alone_body(request, decision.decode)
                response = await exchange.decode_head()
            elif pd.protocol == "vllm":
                prefill.content = _vllm_prefill(request)
                answer = await exchange.prefill_whole()
                try:
                    decode.content = _vllm_decode(request, answer.body)
                except msgspec.DecodeError:
                    raise exchange.fail(prefill, ValueError("its answer is not JSON")) from None
                response = await exchange.decode_head()
            else:
                await self._sglang_bodies(request, decision, prefill, decode)
                on_prefill = _ignored
                if request.logprob:  # the prefill's input logprobs go in front
                    prefilled = done = loop.create_future()

                    def on_prefill(whole: Whole | None) -> None:
                        if not done.done():
                            done.set_result(whole)

                response = await exchange.concurrent(on_prefill)
        except LegFailed as exc:
            service.requests.record(
                request.endpoint, decision.decode, decision.prompt_tokens, exc.status
            )
            return error_answer(
                request.endpoint, exc.status, str(exc), error_kind(exc.status), None, shown
            )
        except BaseException:
            exchange.cancel()
            raise
        return await self._relay(exchange, response, request, decision, shown, prefilled)

    def _leg(
        self,
        pool: Pool,
        decision: RouteDecision,
        request: PDRequest,
        lines: bytes,
        timeout: float | None,
    ) -> Leg:
        """A leg to ``decision``'s holder, counted in flight from here (its body set
        later); ``lines``: the client's header lines to pass on."""
        if self.pd.protocol == "vllm":
            lines += b"%s: %d\r\n" % (_RANK_HEADER, decision.dp_rank)
        url = self.service.spec(decision.worker).url
        path = _PATHS[request.endpoint]
        return Leg(
            pool, decision, url, path, b"", lines, self.service.router.begin(decision), timeout
        )

    def _alone_body(self, request: PDRequest, decision: RouteDecision) -> bytes:
        if self.pd.protocol == "vllm":  # the rank is the header
            return request.raw
        if request.spliced_alone:
            return pinned_bytes(request.raw, decision.dp_rank)
        return _ENCODER.encode(pinned_body(request.body, decision.dp_rank))

    async def _sglang_bodies(
        self, request: PDRequest, decision: PDDecision, prefill: Leg, decode: Leg
    ) -> None:
        assert decision.prefill is not None
        worker = decision.prefill.worker
        port = await self.pd.bootstrap_port(worker, self.service.upstream)
        rooms = new_rooms(len(request.prompts), request.samples, batched=request.batched)
        host = self._hosts.get(prefill.url)
        if host is None:
            if len(self._hosts) >= 1024:  # a fleet has a few engines: this is only a bound
                self._hosts.clear()
            host = self._hosts[prefill.url] = urlsplit(prefill.url).hostname or "127.0.0.1"
        ranks = {"prefill_rank": decision.prefill.dp_rank, "decode_rank": decision.decode.dp_rank}
        fields = request.fields
        if fields is not None and not fields.leg_keys:
            prefill.content, decode.content = sglang_leg_bytes(
                request.raw, fields, host=host, port=port, rooms=rooms, **ranks
            )
            return
        prefill_body, decode_body = sglang_legs(
            request.body, host=host, port=port, rooms=rooms, **ranks
        )
        prefill.content = _ENCODER.encode(prefill_body)
        decode.content = _ENCODER.encode(decode_body)

    # --- the decode's answer ---

    async def _relay(
        self,
        exchange: PDExchange,
        response: Response,
        request: PDRequest,
        decision: PDDecision,
        shown: list[tuple[bytes, bytes]],
        prefilled: asyncio.Future[Whole | None] | None,
    ) -> Answer:
        service, decode = self.service, exchange.decode
        status = response.status
        service.requests.record(request.endpoint, decision.decode, decision.prompt_tokens, status)
        headers = [*_engine_headers(response.headers), *shown]
        logprobs = prefilled
        if not request.stream or status != 200:
            try:
                payload = await response.read()
            except FORWARD_ERRORS as exc:
                response.release()
                exchange.decode_failed(exc)
                failed = (
                    f"the decode engine {decode.url} failed midway: {type(exc).__name__}: {exc}"
                )
                return error_answer(request.endpoint, 502, failed, "bad_gateway", None, shown)
            except BaseException:
                response.release()
                exchange.cancel()
                raise
            response.release()
            exchange.end(decode, failed=status != 200)
            if status == 200:
                service.requests.record_usage(decode.ticket.holder, engine_usage_of_json(payload))
                if request.endpoint == "generate":
                    payload = await generate_answer(payload, decision, logprobs)
            return Answer(status, headers, payload)
        response.on_end(lambda: exchange.end(decode, failed=False))

        async def relay() -> AsyncIterator[bytes]:
            tracker = UsageTracker()
            chunks = response.chunks()
            if logprobs is not None:
                chunks = merged_first_event(chunks, logprobs)
            try:
                async for chunk in chunks:
                    tracker.feed(chunk)
                    yield chunk
            except FORWARD_ERRORS as exc:
                exchange.decode_failed(exc)
                midway = (
                    f"the decode engine {decode.url} failed midway: {type(exc).__name__}: {exc}"
                )
                yield b"event: error\ndata: " + OpenAIError(502, midway, "bad_gateway").body()
                yield b"\n\n"
            finally:
                response.release()
                service.requests.record_usage(decode.ticket.holder, tracker.usage())

        return Answer(status, headers, stream=relay(), release=response.release)


def _vllm_prefill(request: PDRequest) -> bytes:
    """vLLM's prefill leg: spliced into the client's bytes when its body allows, else
    rebuilt (:mod:`kvevents.router.serve.pd_body`)."""
    fields = request.fields
    if fields is not None and not fields.vllm_drops:
        return vllm_prefill_bytes(request.raw, fields)
    return _ENCODER.encode(vllm_prefill_body(request.body))


def _vllm_decode(request: PDRequest, answer: bytes) -> bytes:
    """vLLM's decode leg, with the prefill's ``answer``'s ``kv_transfer_params``: spliced
    when the body was read plain, else rebuilt; ``msgspec.DecodeError`` when the answer
    is not JSON."""
    if request.fields is not None:
        return vllm_decode_bytes(request.raw, transfer_params(answer))
    return _ENCODER.encode(vllm_decode_body(request.body, msgspec.json.decode(answer)))


def _ignored(whole: Whole | None) -> None:
    """A prefill's answer nobody reads (no input logprobs asked for)."""
