"""The routing hot path over real HTTP: answers, errors, limits, and N processes on one port.

Answers, errors and limits are checked on the router's own HTTP stack."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from kvevents import Holder, Router
from kvevents.index.types import HolderMatch
from kvevents.router.decide.scoring import HolderScore
from kvevents.router.serve.hot_path import ScoreAnswer, encode_route_answer, route_answer

PAGE = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(["--dp-size", "4", "--page-size", str(PAGE)], KV_CONFIG)


@pytest.fixture(scope="module")
def router(make_router: Callable[..., RouterProc], engine: Engine) -> RouterProc:
    proc = make_router([engine.url], "--max-body-bytes", "200000", streams=4)
    # every request below takes the native path (kvevents.kernels), from the first
    assert _kernels(proc) == "compiled"
    return proc


def _kernels(router: RouterProc) -> str:
    state: str = router.http.get("/workers").json()["process"]["kernels"]
    return state


def _by_rank(answer: dict[str, Any]) -> dict[str, Any]:
    """A /query answer with its matches in rank order (routers list holders as found)."""
    if "matches" in answer:
        answer["matches"].sort(key=lambda m: (m["worker"], m["dp_rank"]))
    return answer


def _stored(router: RouterProc, engine: Engine, prompt: list[int], rank: int) -> None:
    engine.generate(prompt, rank=rank)

    def seen() -> bool:  # asked with one token more: every block of the prompt is reusable
        matches = router.post("/query", {"input_ids": [*prompt, 0]}).json()["matches"]
        whole = len(prompt) // PAGE * PAGE
        return any(m["dp_rank"] == rank and m["matched_tokens"] == whole for m in matches)

    wait_until(seen, 10, f"rank {rank}'s blocks in the index")


def test_route_answers_the_top_scores_unless_asked_for_all(
    engine: Engine, router: RouterProc
) -> None:
    """/route answers the choice and the next best (4 by default, `top` N), every one with `all_scores`."""
    prompt = list(range(300, 316))
    _stored(router, engine, prompt, rank=2)
    default = router.post("/route", {"input_ids": prompt}).json()
    assert (default["dp_rank"], default["holders"], len(default["scores"])) == (2, 4, 4)
    assert default["scores"][0]["matched"] == {"gpu": 3, "cpu": 0, "disk": 0}
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
        (b'{"text": "abc\\ud800"}', 400, "surrogate pair"),  # msgspec said "truncated"
        (b'{"text": "a\\\\ud800", "top": "x"}', 400, "Expected `int`"),  # text, not an escape
        (b"[1, 2]", 400, "object"),
        (b'{"text": "' + b"a" * 300_000 + b'"}', 413, "--max-body-bytes"),
        (b'{"input_ids": [1, 2, 3, 4], "extra_keys": "x"}', 400, "extra_keys"),
        (  # an int past 64 bits cannot be keyed: it was a 500
            b'{"input_ids": [1, 2, 3, 4], "extra_keys": [["img", 18446744073709551616]]}',
            400,
            "block 0's extra keys",
        ),
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


def test_a_fresh_router_answers_natively_from_its_first_request(engine: Engine) -> None:
    """Nothing is compiled or loaded at run time: the first /route a new router answers
    is parsed, keyed and matched by the native core, and /workers counts those calls."""
    fresh = RouterProc([engine.url])
    try:
        wait_until(lambda: fresh.connected() == 4, 20, "all four streams connected")
        before = fresh.http.get("/workers").json()["process"]
        assert before["kernels"] == "compiled"
        assert before["native"]["status"] == "loaded" and before["native"]["built"]
        assert before["native"]["calls"]["parse"] == 0
        assert fresh.post("/route", {"input_ids": list(range(64))}).status_code == 200
        calls = fresh.http.get("/workers").json()["process"]["native"]["calls"]
        assert calls["parse"] == 1 and calls["keys"] + calls["choice"] >= 1, calls
    finally:
        fresh.stop()


def test_a_router_without_kernels_answers_alike(engine: Engine, router: RouterProc) -> None:
    """KVEVENTS_KERNELS=0 turns the compiled path off (and /workers and /metrics say
    so); the answers are the same, bodies on and off the compiled path alike."""
    plain = RouterProc([engine.url], env={"KVEVENTS_KERNELS": "0"})
    try:
        wait_until(lambda: plain.connected() == 4, 20, "all four streams connected")
        assert _kernels(plain) == "off: KVEVENTS_KERNELS=0"
        assert 'kernels="off"' in plain.http.get("/metrics").text
        assert 'kernels="compiled"' in router.http.get("/metrics").text
        # prompts of their own per router (the engine and its cache outlive each one)
        base = 1_000_000 + 1_000 * httpx.URL(router.url).port
        # a first prompt seen by the new router proves its subscriptions are live
        _stored(plain, engine, list(range(base, base + 16)), rank=0)
        prompt = list(range(base + 100, base + 164))
        _stored(router, engine, prompt, rank=1)
        wait_until(
            lambda: (
                _by_rank(plain.post("/query", {"input_ids": prompt}).json())
                == _by_rank(router.post("/query", {"input_ids": prompt}).json())
            ),
            10,
            "both routers' indexes hold the prompt",
        )
        bodies = [
            json.dumps({"input_ids": prompt}).encode(),
            json.dumps({"input_ids": prompt[:40], "top": 2}, separators=(",", ":")).encode(),
            b'{"input_ids": [' + b" , ".join(b"%d" % t for t in prompt) + b"], \n}",
            b'{"input_ids": [1, 2, 3, 4], "top": 0}',
            b'{"input_ids": [1, 2, 3, 4.5]}',
            b'{"input_ids": [1], "input_ids": ' + json.dumps(prompt).encode() + b"}",
        ]
        for path in ("/query", "/route"):
            for body in bodies:
                answers = [
                    proc.http.post(path, content=body, headers={"content-type": "application/json"})
                    for proc in (router, plain)
                ]
                assert answers[0].status_code == answers[1].status_code, body
                if path == "/route" and answers[0].status_code == 200:  # loads differ: the choice
                    ours, theirs = (a.json() for a in answers)
                    assert ours["n_blocks"] == theirs["n_blocks"]
                    assert ours["scores"][0]["matched"] == theirs["scores"][0]["matched"]
                else:
                    assert _by_rank(answers[0].json()) == _by_rank(answers[1].json()), body
    finally:
        plain.stop()


def test_plain_routes_and_queries_are_answered_natively_and_alike(engine: Engine) -> None:
    """A body of token ids alone is answered by the native call (kvevents.kernels.native)
    once the loads hold still, with the bytes the Python path writes for the same
    request: the body with ``"top": 4`` (the default, but another member, so Python
    answers it) asked of the same router right after; a relayed request's holder is
    chosen natively, as Python chooses it. KVEVENTS_NATIVE=0 turns it off."""
    fast = RouterProc([engine.url])
    slow = RouterProc([engine.url], env={"KVEVENTS_NATIVE": "0"})
    try:
        for proc in (fast, slow):
            wait_until(lambda p=proc: p.connected() == 4, 20, "all four streams connected")
            assert _kernels(proc) == "compiled"
        base = 2_000_000 + 1_000 * httpx.URL(fast.url).port
        prompt = list(range(base, base + 40))
        _stored(fast, engine, prompt, rank=3)
        asked = [prompt, prompt[:9], [*prompt, 7, 8, 9, 10, 11], []]

        def alike(ids: list[int], plain: bytes) -> bool:
            """The native answer and then the Python one, the same (false if the loads
            changed in between: the engine's load is polled)."""
            with_top = json.dumps({"input_ids": ids, "top": 4}).encode()
            answers = [
                fast.http.post("/route", content=b, headers={"content-type": "application/json"})
                for b in (plain, plain, with_top)  # the first after a change makes the ranking
            ]
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            return answers[1].content == answers[2].content

        for ids in asked:
            plain = json.dumps({"input_ids": ids}).encode()
            wait_until(lambda i=ids, b=plain: alike(i, b), 10, f"the same answers for {ids[:3]}")
        spaced = b' {"input_ids" : [' + b" , ".join(b"%d" % t for t in prompt) + b"] }\n"
        wait_until(lambda: alike(prompt, spaced), 10, "the same answers for a spaced body")
        native = fast.http.get("/workers").json()["process"]["native"]
        assert native["status"] == "loaded" and native["built"] and native["loaded"], native
        assert native["answered"] >= len(asked) + 1, native
        assert native["calls"]["route"] >= len(asked) + 1, native
        # /query: the native answer, then the Python one (for a body with another member)
        for ids in asked:
            answered = fast.http.get("/workers").json()["process"]["native"]["answered"]
            plain = fast.post("/query", {"input_ids": ids})
            python = fast.post("/query", {"input_ids": ids, "top": 4})
            assert plain.status_code == python.status_code == 200
            assert plain.content == python.content
            native = fast.http.get("/workers").json()["process"]["native"]
            assert native["answered"] == answered + 1
        # relayed requests (each one changes the loads) are chosen by the native call over
        # the load board, as the Python path chooses them
        for proc in (fast, slow):
            for _ in range(3):
                relayed = proc.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
                assert relayed.status_code == 200, relayed.text
                assert relayed.headers["x-kvevents-dp-rank"] == "3"
                assert relayed.headers["x-kvevents-matched-tokens"] == str(len(prompt) - PAGE)
        native = fast.http.get("/workers").json()["process"]["native"]
        assert native["chosen"] >= 2, native  # the first may find the loads' ranking kept
        for ids in asked:
            assert slow.post("/route", {"input_ids": ids}).status_code == 200
        off = slow.http.get("/workers").json()["process"]["native"]
        calls = off.pop("calls")
        assert off == {
            "status": "off: KVEVENTS_NATIVE=0",
            "built": True,
            "loaded": False,
            "answered": 0,
            "chosen": 0,
            "failures": 0,
        }
        assert calls["route"] == calls["query"] == calls["choice"] == 0, calls
        assert calls["parse"] > 0 and calls["match"] > 0, "the parts stay on"
        assert fast.http.get("/workers").json()["process"]["native"]["failures"] == 0
    finally:
        fast.stop()
        slow.stop()


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


def test_a_route_answer_score_carries_every_field_of_the_holder_score() -> None:
    """/route's score answer (ScoreAnswer.of) says every figure a HolderScore holds, by the
    same names, matched as an object: a field added to one and not the other fails here."""
    assert ScoreAnswer.__struct_fields__ == HolderScore.__struct_fields__
    score = HolderScore(
        worker="http://e:1",
        dp_rank=3,
        matched=HolderMatch(5, 2, 1),
        cached_blocks=6.5,
        prefill_blocks=1.5,
        pending_blocks=2.0,
        cost=1.7,
        routed=9,
        available=False,
        recent_blocks=4.0,
        balance_blocks=0.5,
        predicted_blocks=2,
    )
    answer = msgspec.json.decode(msgspec.json.encode(ScoreAnswer.of(score)))
    expected = msgspec.structs.asdict(score)
    expected["matched"] = {"gpu": 5, "cpu": 2, "disk": 1}
    assert answer == expected


def test_the_route_answer_written_is_the_schema_struct_encoded() -> None:
    """What /route writes is exactly RouteAnswer encoded, request after request and as
    the loads change."""
    router = Router(block_size=4)
    for rank in range(6):
        router.add_holder(Holder("http://e:1", rank))
    held = Holder("http://e:1", 2)
    router.index.store_keys(held, router.index.request_keys(list(range(16))))
    prompts = [list(range(16)), list(range(100, 116)), list(range(8)) + [7] * 8]
    for round_ in range(3):
        for prompt in prompts:
            for top in (1, 4, None):
                decision = router.route(prompt, top=top)
                written = encode_route_answer(decision, recorded=False, top=top)
                schema = route_answer(decision, recorded=False, top=top)
                assert written == msgspec.json.encode(schema)
        router.begin(router.route(prompts[round_], top=1))  # the loads change
