"""The relay's decision headers: the decision's own figures, as the bytes a server writes."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from kvevents.index.types import HolderMatch
from kvevents.router.decide.router import RouteDecision
from kvevents.router.decide.scoring import HolderScore
from kvevents.router.serve import relay_headers
from kvevents.router.serve.relay_answer import OpenAIError
from kvevents.router.serve.relay_headers import decision_headers


def _score(worker: str, rank: int, matched: HolderMatch, predicted: int) -> HolderScore:
    cached = float(matched.gpu + matched.cpu + matched.disk)
    return HolderScore(
        worker=worker,
        dp_rank=rank,
        matched=matched,
        cached_blocks=cached,
        prefill_blocks=max(0.0, 12 - cached),
        pending_blocks=0.0,
        cost=cached,
        routed=0,
        available=True,
        predicted_blocks=predicted,
    )


def _decision(worker: str, *, gpu: int, cpu: int, disk: int, predicted: int) -> RouteDecision:
    """A decision for ``worker``'s rank 3, with a runner-up whose figures all differ."""
    chosen = _score(worker, 3, HolderMatch(gpu, cpu, disk), predicted)
    other = _score("http://other:1", 0, HolderMatch(9, 9, 9), 7)
    return RouteDecision(
        worker=worker,
        dp_rank=3,
        n_blocks=12,
        block_size=16,
        scores=[chosen, other],
        policy="round-robin",
    )


def test_the_headers_are_the_chosen_holders_figures() -> None:
    """Tokens matched in every tier and predicted, of the chosen holder (not the runner-up),
    the rank, the policy, and the worker URL percent-quoted."""
    worker = "http://engine:8000/päth with space"
    decision = _decision(worker, gpu=3, cpu=1, disk=2, predicted=2)
    expected = [
        (b"x-kvevents-worker", quote(worker, safe=":/?&=@[]+,;~!$'()*").encode("latin-1")),
        (b"x-kvevents-dp-rank", b"3"),
        (b"x-kvevents-matched-tokens", str(decision.matched_tokens).encode()),
        (b"x-kvevents-prompt-tokens", b"200"),
        (b"x-kvevents-policy", b"round-robin"),
        (b"x-kvevents-predicted-tokens", str(decision.predicted_tokens).encode()),
    ]
    assert decision_headers(decision, 200) == expected
    assert expected[2][1] == b"96" and expected[5][1] == b"32"
    assert decision_headers(decision, 200) == expected  # the quoted worker is reused alike


def test_the_quoted_worker_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """More workers than the bound: the cache is cleared, never grows past it, and every
    header still names its own worker."""
    monkeypatch.setattr(relay_headers, "_QUOTED_WORKERS", {})
    monkeypatch.setattr(relay_headers, "_QUOTED_WORKERS_MAX", 2)
    for i in range(5):
        worker = f"http://engine-{i}:8000/a b"
        headers = dict(decision_headers(_decision(worker, gpu=1, cpu=0, disk=0, predicted=0), 16))
        assert headers[b"x-kvevents-worker"] == f"http://engine-{i}:8000/a%20b".encode()
        assert len(relay_headers._QUOTED_WORKERS) <= 2


@pytest.mark.parametrize("worker", ["http://engine:8000", "http://engine:8000/päth with space"])
@pytest.mark.parametrize(("gpu", "cpu", "disk", "predicted"), [(0, 0, 0, 0), (3, 1, 2, 2)])
def test_the_written_lines_are_the_headers_as_a_server_writes_them(
    worker: str, gpu: int, cpu: int, disk: int, predicted: int
) -> None:
    """An answer written whole carries the headers as lines formatted in one step: the
    same bytes as writing each pair ``name: value\\r\\n``, in the same order."""
    decision = _decision(worker, gpu=gpu, cpu=cpu, disk=disk, predicted=predicted)
    pairs = decision_headers(decision, 2048)
    assert relay_headers.decision_lines(decision, 2048) == b"".join(
        b"%s: %s\r\n" % pair for pair in pairs
    )


def test_the_engines_headers_as_lines_are_its_pairs_written() -> None:
    """The engine's content type (JSON when it gave none) and retry-after, as lines."""
    for given in ({}, {"content-type": "text/event-stream"}, {"retry-after": "7"}):
        pairs = relay_headers._engine_headers(given)
        assert relay_headers._engine_lines(given) == b"".join(b"%s: %s\r\n" % p for p in pairs)


def test_forwarded_headers_stay_bytes_and_a_line_break_is_refused() -> None:
    """The client's headers go on as the server gave them, repeated ones joined, hop-by-hop
    and Authorization dropped; a value with a line break would write a header of the
    client's own into the engine's request, and is refused (a 400 naming it)."""
    raw = [
        (b"host", b"router:8000"),
        (b"content-length", b"12"),
        (b"authorization", b"Bearer client-key"),
        (b"x-trace", b"a"),
        (b"x-trace", b"b"),
        (b"cookie", b"k=1"),
        (b"cookie", b"j=2"),
        (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"dropped"),
    ]
    kept = relay_headers._forwarded(raw)
    assert kept == {b"x-trace": b"a, b", b"cookie": b"k=1; j=2"}
    assert relay_headers._request_lines(kept) == b"x-trace: a, b\r\ncookie: k=1; j=2\r\n"
    for bad in (b"a\r\nx-injected: 1", b"a\nx-injected: 1", b"a\rb"):
        with pytest.raises(OpenAIError, match="'x-trace' has a line break") as e:
            relay_headers._request_lines({b"accept": b"*/*", b"x-trace": bad})
        assert e.value.status == 400
