"""Disaggregated serving's legs on the wire: sending them, failing them, ending their tickets.

:class:`PDExchange` is one request's legs (:class:`Leg`): the decode leg, and the
prefill leg unless it is skipped. It sends them as the protocol says, SGLang's both at
once (:meth:`PDExchange.concurrent`), vLLM's prefill first
(:meth:`PDExchange.prefill_whole`, then the decode), and returns the decode's answer
once its head is in, for the relay to pass on; or raises :class:`LegFailed`, the one
error the client gets, every leg then cancelled or ended.

Invariants:

* each leg's ticket (:meth:`Router.begin`) is finished exactly once: the decode's when
  its answer has ended (the relay's part), the prefill's when its answer has been read
  and the decode's answer has begun; a failed leg, or the other leg failing before the
  decode's answer began, finishes it as failed, which withdraws its predicted blocks;
* a leg that is not needed any more is cancelled, which closes its connection (the
  engine sees the client leave); nothing is left running past its deadline: the
  prefill leg's is ``--prefill-timeout``, the decode's ``--forward-timeout``;
* a prefill whose answer is still to come when the decode's begins (SGLang) is read and
  dropped by a task of its own, kept in :attr:`PDExchange.background` until it ends;
* a leg on a kept-alive connection is written in the step of the event loop that builds
  it, before the request first waits: under a burst the loop's next step comes only after
  every other request ready in this one has been decided, so a leg sent by a task would
  wait for all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse, Response
from kvevents.http.upstream_errors import MidwayError, UpstreamError
from kvevents.router.decide.pd import Pool
from kvevents.router.decide.router import RouteDecision, Router, Ticket
from kvevents.router.serve.pd_stats import LegFailure, PDStats

__all__ = ["Leg", "LegFailed", "PDExchange", "Whole"]


class Leg:
    """One leg: where it goes, what it sends, and its ticket."""

    __slots__ = ("content", "decision", "headers", "path", "pool", "ticket", "timeout", "url")

    def __init__(
        self,
        pool: Pool,
        decision: RouteDecision,
        url: str,
        path: str,
        content: bytes,
        headers: bytes,
        ticket: Ticket,
        timeout: float | None,
    ) -> None:
        self.pool = pool
        self.decision = decision
        self.url = url
        self.path = path
        self.content = content
        self.headers = headers
        """Header lines (``name: value\\r\\n`` each), checked."""
        self.ticket = ticket
        self.timeout = timeout
        """Seconds for the whole exchange; None: the client's own (``--forward-timeout``)."""


Whole = FullResponse
"""A leg's whole answer: ``status``, ``headers`` and ``body``."""


class LegFailed(Exception):
    """A leg failed, so the request did: ``status`` and ``message`` for the client."""

    def __init__(self, status: int, message: str, pool: Pool) -> None:
        super().__init__(message)
        self.status = status
        self.pool = pool


class PDExchange:
    """One request's legs (see the module docstring). ``background`` keeps the tasks
    still reading a prefill's answer after the decode's began (the caller cancels them
    at shutdown); ``loop`` is the running one."""

    def __init__(
        self,
        upstream: Upstream,
        router: Router,
        stats: PDStats,
        background: set[asyncio.Task[None]],
        decode: Leg,
        prefill: Leg | None = None,
        *,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.loop = loop
        """The running loop (asked for once per request by the caller)."""
        self.upstream = upstream
        self.router = router
        self.stats = stats
        self.background = background
        self.decode = decode
        self.prefill = prefill
        self._ended: set[Pool] = set()
        self._answered: set[Pool] = set()
        """Legs whose answer came whole and 200 (not counted as cancelled after that)."""

    # --- tickets and failures ---

    def end(self, leg: Leg, *, failed: bool) -> None:
        """Finish ``leg``'s ticket, once."""
        if leg.pool in self._ended:
            return
        self._ended.add(leg.pool)
        self.router.finish(leg.ticket, failed=failed)

    def _end_others(self, leg: Leg) -> None:
        """Every leg but ``leg`` ends failed; those that had not answered count as cancelled."""
        other = self.prefill if leg is self.decode else self.decode
        if other is None:
            return
        if other.pool not in self._ended and other.pool not in self._answered:
            self.stats.failed(other.pool, "cancelled")
        self.end(other, failed=True)

    def fail(
        self, leg: Leg, exc: BaseException | None, status: int = 0, body: bytes = b""
    ) -> LegFailed:
        """``leg`` failed (``exc``, or an error ``status`` answering ``body``): every leg
        ends failed, the failure is counted, and the client's error is returned."""
        reason: LegFailure = "status" if exc is None else _reason(exc)
        self.stats.failed(leg.pool, reason)
        self._end_others(leg)
        self.end(leg, failed=True)
        what = f"the {leg.pool} engine {leg.url}"
        if exc is None:
            said = body[:300].decode("utf-8", "replace").strip()
            message = f"{what} answered HTTP {status}" + (f": {said}" if said else "")
            return LegFailed(status if 400 <= status < 500 else 502, message, leg.pool)
        if reason == "timeout":
            limit = "" if leg.timeout is None else f" ({leg.timeout:g} s)"
            return LegFailed(504, f"{what} did not answer within its deadline{limit}", leg.pool)
        return LegFailed(502, f"{what} failed: {_describe(exc)}", leg.pool)

    def decode_failed(self, exc: BaseException | None) -> None:
        """The decode's answer began but failed midway (``exc``) or was an error (None)."""
        self.stats.failed("decode", "status" if exc is None else _reason(exc))
        self._end_others(self.decode)
        self.end(self.decode, failed=True)

    def cancel(self) -> None:
        """The request is given up (a shutdown, a bug): every leg not ended ends failed."""
        for leg in (self.decode, self.prefill):
            if leg is not None:
                self.end(leg, failed=True)

    # --- sending ---

    async def send(self, leg: Leg) -> Response:
        """``leg`` sent; its answer once the head is in (raises as :meth:`Upstream.post`)."""
        return await self.upstream.post(
            leg.url, leg.path, leg.content, leg.headers, timeout=leg.timeout
        )

    async def whole(self, leg: Leg) -> Whole:
        """``leg`` sent and its whole answer read (raises as :meth:`Upstream.post`)."""
        response = await self.send(leg)
        try:
            body = await response.read()
        finally:
            response.release()
        return Whole(response.status, response.headers, body)

    async def prefill_whole(self) -> Whole:
        """vLLM's first step: the prefill's whole answer, 200; :class:`LegFailed` else."""
        leg = self.prefill
        assert leg is not None
        try:
            answer = await self.whole(leg)
        except (UpstreamError, TimeoutError) as exc:
            raise self.fail(leg, exc) from None
        if answer.status != 200:
            raise self.fail(leg, None, answer.status, answer.body)
        self._answered.add(leg.pool)
        return answer

    async def decode_head(self) -> Response:
        """The decode's answer once its head is in, the prefill (if any) having answered;
        :class:`LegFailed` when it cannot be sent."""
        try:
            response = await self.send(self.decode)
        except (UpstreamError, TimeoutError) as exc:
            raise self.fail(self.decode, exc) from None
        self._began(response)
        if self.prefill is not None:
            self.end(self.prefill, failed=False)  # nothing if _began ended it failed
        return response

    def _began(self, response: Response) -> None:
        """The decode's answer began: an error status is the decode leg's failure (the
        relay passes the engine's answer on and ends the decode's ticket)."""
        if response.status != 200:
            self.stats.failed("decode", "status")
            self._end_others(self.decode)

    async def concurrent(self, on_prefill: Callable[[Whole | None], None]) -> Response:
        """SGLang's legs, both at once: the decode's answer once its head is in.

        A prefill that fails first (unreachable, past its deadline, an error status)
        cancels the decode, and the other way round, raising :class:`LegFailed`. A
        prefill still answering when the decode's answer begins is read on by a task
        of its own; ``on_prefill`` gets its whole answer (None if it failed).
        """
        prefill, decode = self.prefill, self.decode
        assert prefill is not None
        loop = self.loop
        # both written now (see the module docstring), the prefill's first
        upstream = self.upstream
        prefilling = upstream.post_whole(
            prefill.url, prefill.path, prefill.content, prefill.headers, timeout=prefill.timeout
        )
        decoding = upstream.post_head(
            decode.url, decode.path, decode.content, decode.headers, timeout=decode.timeout
        )
        try:
            if not decoding.done():
                await _first_of(loop, prefilling, decoding)
            if not decoding.done():  # the prefill's answer came first
                failure = self._prefill_failure(prefilling)
                if failure is not None:
                    await _cancelled(loop, decoding)
                    raise failure
                await _first_of(loop, decoding)
            error = decoding.exception()
            if error is not None:
                await _cancelled(loop, prefilling)
                if isinstance(error, (UpstreamError, TimeoutError)):
                    raise self.fail(self.decode, error) from None
                raise error
        except BaseException:
            for task in (prefilling, decoding):
                task.cancel()
            if decoding.done() and not decoding.cancelled() and decoding.exception() is None:
                decoding.result().release()  # it came as the other leg failed
            raise
        response = decoding.result()
        self._began(response)
        if response.status != 200:
            prefilling.cancel()  # the decode's error is the answer: the prefill is not needed
        if prefilling.done():
            self._prefill_ended(prefilling, on_prefill)
        else:
            reading = loop.create_task(self._read_on(prefilling, on_prefill))
            self.background.add(reading)
            reading.add_done_callback(self.background.discard)
        return response

    def _prefill_failure(self, prefilling: asyncio.Future[Whole]) -> LegFailed | None:
        """The client's error when the prefill leg failed, or None when it answered 200."""
        prefill = self.prefill
        assert prefill is not None
        error = prefilling.exception()
        if error is not None:
            if isinstance(error, (UpstreamError, TimeoutError)):
                return self.fail(prefill, error)
            raise error
        answer = prefilling.result()
        if answer.status != 200:
            return self.fail(prefill, None, answer.status, answer.body)
        self._answered.add(prefill.pool)
        return None

    def _prefill_ended(
        self, prefilling: asyncio.Future[Whole], on_prefill: Callable[[Whole | None], None]
    ) -> None:
        """The prefill's answer is in (or given up), after the decode's began: its ticket ends."""
        prefill = self.prefill
        assert prefill is not None
        error = asyncio.CancelledError() if prefilling.cancelled() else prefilling.exception()
        answer = None if error is not None else prefilling.result()
        ok = answer is not None and answer.status == 200
        if not ok and prefill.pool not in self._ended:
            self.stats.failed(prefill.pool, "status" if error is None else _reason(error))
        self.end(prefill, failed=not ok)
        on_prefill(answer if ok else None)

    async def _read_on(
        self, prefilling: asyncio.Future[Whole], on_prefill: Callable[[Whole | None], None]
    ) -> None:
        try:
            await _first_of(self.loop, prefilling)
        finally:
            if not prefilling.done():
                await _cancelled(self.loop, prefilling)
            self._prefill_ended(prefilling, on_prefill)


def _first_of(
    loop: asyncio.AbstractEventLoop, *futures: asyncio.Future[Any]
) -> asyncio.Future[None]:
    """A future of ``loop`` done once any of ``futures`` is (their outcomes left unread):
    what ``asyncio.wait(..., return_when=FIRST_COMPLETED)`` waits for, without the
    running loop asked for (a system call each time) and the set of futures it builds."""
    first: asyncio.Future[None] = loop.create_future()

    def done(_: asyncio.Future[Any]) -> None:
        if not first.done():
            first.set_result(None)

    for future in futures:
        future.add_done_callback(done)
    return first


async def _cancelled(loop: asyncio.AbstractEventLoop, task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended (its connection closed)."""
    task.cancel()
    await _first_of(loop, task)
    if not task.cancelled():
        task.exception()  # retrieved: it ended as it would, the request is answered apart


def _reason(exc: BaseException) -> LegFailure:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, MidwayError) and isinstance(exc.cause, TimeoutError):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "unreachable"


def _describe(exc: BaseException) -> str:
    text = str(exc) or "no answer"
    return f"{type(exc).__name__}: {text}"
