"""The router's relay in disaggregated (P/D) mode: ``/v1/completions``, chat, ``/generate``.

Each request is read (bounded), its prompts tokenized as in one-pool mode (a batch of
prompts, a chat, text or token ids; ``/generate`` takes ``input_ids`` or ``text``, one
or a list), routed by :func:`~kvevents.router.decide.pd.decide_pd` (the decode holder,
and the prefill holder unless the decode can prefill alone), counted on each leg's
holder (:meth:`Router.begin`), and sent:

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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from urllib.parse import urlsplit

import msgspec

from kvevents.errors import RouterNotReadyError
from kvevents.http.upstream import Response
from kvevents.router.decide.models import UnknownModelError
from kvevents.router.decide.pd import PDDecision, Pool, decide_pd
from kvevents.router.decide.router import RouteDecision
from kvevents.router.prompts.completion_body import RelayFields
from kvevents.router.serve.openai_relay import (
    RANK_HEADER,
    Answer,
    OpenAIError,
    OpenAIRelay,
    _engine_headers,
    _json_object,
    _request_lines,
    _UsageTracker,
    prompts_of,
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
from kvevents.router.serve.pd_request import (
    PD_PATHS,
    Endpoint,
    PDRequest,
    error_answer,
    error_kind,
    generate_answer,
    generate_request,
    pd_headers,
    samples_of,
)
from kvevents.router.serve.pd_sse import merged_first_event
from kvevents.router.serve.request_stats import engine_usage_of_json
from kvevents.router.serve.service import FORWARD_ERRORS, RouterService

__all__ = ["PDRelay"]

_PATHS: Mapping[Endpoint, str] = {endpoint: path for path, endpoint in PD_PATHS.items()}
_RANK_HEADER = RANK_HEADER.encode("latin-1")
_ENCODER = msgspec.json.Encoder()
_JSON = (b"content-type", b"application/json")


class PDRelay(OpenAIRelay):
    """Answers :data:`PD_PATHS` for ``service`` in P/D mode (``pd``)."""

    def __init__(self, service: RouterService, pd: PDMode, *, max_body_bytes: int) -> None:
        super().__init__(service, max_body_bytes=max_body_bytes)
        self.pd = pd

    def inline(self, raw_headers: list[tuple[bytes, bytes]], raw: bytes) -> None:
        """Never inline: every P/D request goes the ASGI way (two legs, tasks)."""
        return None

    async def answer_path(self, path: str, headers: dict[bytes, bytes], raw: bytes) -> Answer:
        endpoint = PD_PATHS[path]
        try:
            request = await self._request(endpoint, raw)
            decision = self._decide(request)
            return await self._serve(request, decision, headers)
        except OpenAIError as exc:
            return error_answer(endpoint, exc.status, str(exc), exc.kind, exc.param)

    # --- reading and deciding ---

    async def _request(self, endpoint: Endpoint, raw: bytes) -> PDRequest:
        what = {"completions": "completions", "chat": "chat completions", "generate": "generate"}
        body = _json_object(raw, what[endpoint])
        if endpoint == "generate":
            return await generate_request(body, self.service.text_tokenizer)
        samples = samples_of(body.get("n", 1), "n")
        stream = RelayFields.of(body).wants_stream
        if endpoint == "chat":
            prompts: list[Sequence[int]] = [await self._chat_tokens(body)]
            return PDRequest(endpoint, body, prompts, batched=False, samples=samples, stream=stream)
        given = prompts_of(body)
        prompts = [await self._prompt_tokens(body, p) for p in given]
        batched = isinstance(body["prompt"], list) and isinstance(body["prompt"][0], (str, list))
        return PDRequest(endpoint, body, prompts, batched=batched, samples=samples, stream=stream)

    def _decide(self, request: PDRequest) -> PDDecision:
        extra = request.body.get("extra_keys") if request.endpoint == "generate" else None
        try:
            return decide_pd(
                self.service.router,
                self.pd.pools,
                request.prompts,
                max_local_prefill_tokens=self.pd.max_local_prefill_tokens,
                policy=self.service.policy,
                lora=request.lora,
                cache_salt=request.salt,
                model=request.model,
                extra_keys=extra if isinstance(extra, list) and len(request.prompts) == 1 else None,
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
        exchange = PDExchange(service.upstream, router, pd.stats, pd.background, decode, prefill)
        prefilled: asyncio.Future[Whole | None] | None = None
        try:
            if prefill is None:
                decode.content = self._alone_body(request, decision.decode)
                response = await exchange.decode_head()
            elif pd.protocol == "vllm":
                prefill.content = _ENCODER.encode(vllm_prefill_body(request.body))
                answer = await exchange.prefill_whole()
                try:
                    prefill_json = msgspec.json.decode(answer.body)
                except msgspec.DecodeError:
                    raise exchange.fail(prefill, ValueError("its answer is not JSON")) from None
                decode.content = _ENCODER.encode(vllm_decode_body(request.body, prefill_json))
                response = await exchange.decode_head()
            else:
                await self._sglang_bodies(request, decision, prefill, decode)
                prefilled = asyncio.get_running_loop().create_future()
                done = prefilled

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
            return _ENCODER.encode(request.body)
        return _ENCODER.encode(pinned_body(request.body, decision.dp_rank))

    async def _sglang_bodies(
        self, request: PDRequest, decision: PDDecision, prefill: Leg, decode: Leg
    ) -> None:
        assert decision.prefill is not None
        worker = decision.prefill.worker
        port = await self.pd.bootstrap_port(worker, self.service.client)
        rooms = new_rooms(len(request.prompts), request.samples, batched=request.batched)
        prefill_body, decode_body = sglang_legs(
            request.body,
            host=urlsplit(prefill.url).hostname or "127.0.0.1",
            port=port,
            rooms=rooms,
            prefill_rank=decision.prefill.dp_rank,
            decode_rank=decision.decode.dp_rank,
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
        logprobs = prefilled if request.logprob else None
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
            tracker = _UsageTracker()
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
