"""The routing hot path over real HTTP: answers, errors, limits, and N processes on one port."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_support import KV_CONFIG, Engine, RouterProc, wait_until

PAGE = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(["--dp-size", "4", "--page-size", str(PAGE)], KV_CONFIG)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def router(engine: Engine) -> Iterator[RouterProc]:
    proc = RouterProc([engine.url], "--max-body-bytes", "200000")
    wait_until(lambda: proc.connected() == 4, 20, "all four streams connected")
    yield proc
    proc.stop()


def _stored(router: RouterProc, engine: Engine, prompt: list[int], rank: int) -> None:
    engine.generate(prompt, rank=rank)

    def seen() -> bool:
        matches = router.post("/query", {"input_ids": prompt}).json()["matches"]
        return any(m["dp_rank"] == rank and m["matched_tokens"] == len(prompt) for m in matches)

    wait_until(seen, 10, f"rank {rank}'s blocks in the index")


def test_route_answers_the_top_scores_unless_asked_for_all(
    engine: Engine, router: RouterProc
) -> None:
    """/route answers the choice and the next best (4 by default, `top` N), every one with `all_scores`."""
    prompt = list(range(300, 316))
    _stored(router, engine, prompt, rank=2)
    default = router.post("/route", {"input_ids": prompt}).json()
    assert (default["dp_rank"], default["holders"], len(default["scores"])) == (2, 4, 4)
    assert default["scores"][0]["matched"] == {"gpu": 4, "cpu": 0, "disk": 0}
    top1 = router.post("/route", {"input_ids": prompt, "top": 1}).json()
    assert [s["dp_rank"] for s in top1["scores"]] == [2]
    every = router.post("/route", {"input_ids": prompt, "top": 1, "all_scores": True}).json()
    assert sorted(s["dp_rank"] for s in every["scores"]) == [0, 1, 2, 3]
    assert router.post("/route", {"input_ids": prompt, "top": 0}).status_code == 400


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{", 400, "truncated"),
        (b'{"input_ids": "abc"}', 400, "input_ids"),
        (b'{"input_ids": [-1]}', 400, "input_ids"),
        (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
        (b'{"text": "\\ud800"}', 400, "request body"),  # msgspec refuses lone surrogates
        (b"[1, 2]", 400, "object"),
        (b'{"text": "' + b"a" * 300_000 + b'"}', 413, "--max-body-bytes"),
        (b'{"input_ids": [1, 2, 3, 4], "extra_keys": "x"}', 400, "extra_keys"),
        (
            b'{"input_ids": [1, 2, 3, 4], "extra_keys": [["s1"]], "cache_salt": "s2"}',
            400,
            "give the salt once",
        ),
    ],
)
def test_bad_bodies_answer_4xx_and_the_connection_stays_usable(
    router: RouterProc, body: bytes, status: int, says: str
) -> None:
    """Each malformed or oversized body answers its 4xx naming the problem; the next request works."""
    with httpx.Client(base_url=router.url, timeout=10.0) as client:
        for path in ("/route", "/query"):
            bad = client.post(path, content=body, headers={"content-type": "application/json"})
            assert bad.status_code == status, bad.text
            assert says in bad.json()["error"]
            good = client.post(path, json={"input_ids": [1, 2, 3, 4]})
            assert good.status_code == 200, good.text


def test_a_chunked_body_past_the_limit_is_refused(router: RouterProc) -> None:
    """A body without Content-Length is counted as it arrives and refused past the limit."""

    def chunks() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(30):
            yield b"a" * 10_000
        yield b'"}'

    with httpx.Client(base_url=router.url, timeout=10.0) as client:
        answer = client.post("/query", content=chunks())
        assert answer.status_code == 413


def test_workers_share_one_port_and_each_others_load(engine: Engine) -> None:
    """With --workers 2 both processes answer on one port, each follows every stream, and a
    request one of them records counts in the other's balance."""
    proc = RouterProc([engine.url], "--workers", "2")
    try:
        seen: dict[int, dict[str, object]] = {}

        def both_answered() -> bool:
            with httpx.Client(base_url=proc.url, timeout=10.0) as fresh:  # a new connection
                info = fresh.get("/workers").json()
            seen[info["process"]["index"]] = info
            return len(seen) == 2 and all(
                sum(s["status"] == "connected" for s in w["streams"]) == 4 for w in seen.values()
            )

        wait_until(both_answered, 30, "both processes answering, each with four streams")
        assert {w["process"]["workers"] for w in seen.values()} == {2}
        prompt = list(range(900, 964))
        for _ in range(8):  # recorded by whichever process answers each new connection
            with httpx.Client(base_url=proc.url, timeout=10.0) as fresh:
                answer = fresh.post("/route", json={"input_ids": prompt, "record": True})
                assert answer.status_code == 200

        def notes_arrived() -> bool:
            totals = {}
            for _ in range(8):
                with httpx.Client(base_url=proc.url, timeout=10.0) as fresh:
                    info = fresh.get("/workers").json()
                totals[info["process"]["index"]] = info
            if len(totals) < 2:
                return False
            notes = [w["process"]["notes"] for w in totals.values()]
            routed = [sum(h["routed"] for h in w["holders"]) for w in totals.values()]
            recent = [
                sum(h["load"]["recent_blocks"] for h in w["holders"]) for w in totals.values()
            ]
            return (
                sum(n["sent"] for n in notes) == 8
                and sum(n["received"] for n in notes) == 8
                and sum(routed) == 8
                and all(r > 0 for r in recent)  # both saw every request's recent work
            )

        wait_until(notes_arrived, 20, "every recorded route noted in both processes")
        metrics = httpx.get(f"{proc.url}/metrics", timeout=10.0).text
        assert 'kvevents_router_process_info{index="' in metrics
    finally:
        proc.stop()
