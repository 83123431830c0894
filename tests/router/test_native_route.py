"""The native /route answer (kvevents.kernels._native) is the Python path's, byte for byte.

The native choice of a relayed request over the load board is the Python path's too.

Two routers are given the same holders, blocks, loads and credits; one answers a plain
``/route`` natively, the other in Python. Their answers must be the same bytes, and
their indexes must record the match alike (a lookup, the recency of the blocks
matched). Every case the native call does not take (offloaded tiers, predictions, more
than 64 slots, blocks past 60 tokens, no ranking kept, no available holder) must answer
None, so that the Python path answers it.
"""

from __future__ import annotations

import contextlib
import random
import struct
from array import array
from collections.abc import Callable
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvevents import Holder, ScoringWeights, TierCredits, kernels
from kvevents.errors import RouterNotReadyError
from kvevents.index import Tier
from kvevents.index import predictions as predictions_module
from kvevents.kernels import native
from kvevents.router.decide.router import RouteDecision, Router
from kvevents.router.prompts.token_body import PLAIN_BODY, TokensBody
from kvevents.router.serve.hot_path import HotPath, encode_route_answer
from kvevents.wire.hashing import content_keys_per_block

module = native.load()
pytestmark = pytest.mark.skipif(module is None, reason=f"the extension is off: {native.status()}")


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    assert kernels.load() is not None, kernels.status()  # the native call reads its mirror


def test_keys_are_xxh3_chained_for_every_block_size() -> None:
    assert module is not None
    rng = random.Random(7)
    for block_size in range(1, module.MAX_BLOCK_TOKENS + 1):
        for blocks in (0, 1, 2, 9):
            tokens = array("I", [rng.getrandbits(32) for _ in range(block_size * blocks + 3)])
            parent = rng.choice([0, 1, 2**64 - 1, rng.getrandbits(64)])
            got = array("Q", module.chain_keys(tokens, block_size, parent))
            assert list(got) == content_keys_per_block(tokens, block_size, parent), block_size


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_floats_are_written_as_msgspec_writes_them_or_not_at_all(x: float) -> None:
    assert module is not None
    written = module.json_float(x)
    if written is not None:
        assert written == msgspec.json.encode(x)
    else:  # msgspec would write an exponent (or the value is no JSON number)
        assert not (x == 0.0 or 1e-4 <= abs(x) < 1e16)


def test_floats_on_the_edges() -> None:
    assert module is not None
    for x in (0.0, -0.0, 1e-4, 0.1, 1.0, 2.5, 1e15, 9007199254740993.0, 9999999999999998.0):
        assert module.json_float(x) == msgspec.json.encode(x)
    for x in (9.999e-5, 1e16, 1e300, float("inf"), float("nan"), 5e-324):
        assert module.json_float(x) is None


_WORKERS = ["http://e0:8000", 'http://we"ird\\name', "http://ünïcode\n"]


@st.composite
def fleets(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    count = draw(st.integers(1, 9))
    holders = [Holder(_WORKERS[i % 3], i // 3) for i in range(count)]
    prompts = [
        draw(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=12 * block_size))
        for _ in range(3)
    ]
    prompts.append(prompts[0] + draw(st.lists(st.integers(0, 50), max_size=4 * block_size)))
    stored = [
        (draw(st.integers(0, count - 1)), draw(st.integers(0, 3)), draw(st.integers(0, 12)))
        for _ in range(draw(st.integers(0, 8)))
    ]
    loads = [
        (
            draw(st.integers(0, 2)),
            draw(st.integers(0, count)),
            draw(st.integers(0, 3)),
            draw(st.integers(0, 3)),
            draw(st.booleans()),
        )
        for _ in range(draw(st.integers(0, 4)))
    ]
    records = draw(st.lists(st.integers(0, 3), max_size=4))
    credits = draw(st.sampled_from([TierCredits(), TierCredits(gpu=0.3), TierCredits(gpu=0.0)]))
    weights = draw(
        st.sampled_from(
            [
                ScoringWeights(),
                ScoringWeights(load_weight=1.0, balance_weight=0.0),
                ScoringWeights(load_weight=0.3, balance_weight=0.7),
            ]
        )
    )
    asked = draw(st.integers(0, 3))
    cut = draw(st.integers(0, len(prompts[asked])))
    return {
        "block_size": block_size,
        "holders": holders,
        "prompts": prompts,
        "stored": stored,
        "loads": loads,
        "records": records,
        "credits": credits,
        "weights": weights,
        "request": prompts[asked][:cut] if draw(st.booleans()) else prompts[asked],
    }


def _fleet(
    case: dict,
    *,
    natively: bool,
    clock: Callable[[], float] | None = None,
    stall_after_s: float | None = None,
) -> Router:
    """A router in the state ``case`` describes (the same state for the same case);
    with a ``clock``, it predicts (a time-to-live of 2 s on that clock), and watches
    stalls when given ``stall_after_s``."""
    router = Router(
        block_size=case["block_size"],
        credits=case["credits"],
        weights=case["weights"],
        prediction_ttl_s=None if clock is None else 2.0,
        stall_after_s=stall_after_s,
        **({} if clock is None else {"clock": clock}),
    )
    if not natively:
        router.native._module = None
    for holder in case["holders"]:
        router.add_holder(holder)
    index = router.index
    for who, which, blocks in case["stored"]:
        tokens = case["prompts"][which][: blocks * case["block_size"]]
        keys = content_keys_per_block(tokens, case["block_size"])
        index.store_keys(case["holders"][who], keys)
    for worker, rank, running, waiting, available in case["loads"]:
        body = {"ranks": [{"dp_rank": rank, "running": running, "waiting": waiting}]}
        body["ranks"][0]["available"] = available
        router.update_load(_WORKERS[worker], body)
    for which in case["records"]:
        with contextlib.suppress(RouterNotReadyError):  # no holder available
            router.record(router.route(case["prompts"][which]))
    return router


def _predicting_fleets(case: dict, predicting: bool, recorded: list[int]) -> tuple[Router, Router]:
    """The native and the Python router of ``case``; when ``predicting``, each has also
    recorded a request of each ``recorded`` prompt, whose blocks are predicted on the
    holder it went to (a clock that stands still: none expires)."""
    clock = (lambda: 0.0) if predicting else None
    routers = _fleet(case, natively=True, clock=clock), _fleet(case, natively=False, clock=clock)
    for router in routers if predicting else ():
        for which in recorded:
            with contextlib.suppress(RouterNotReadyError):  # no holder available
                router.record(router.route(array("I", case["prompts"][which]), top=1))
    return routers


def _python_query(router: Router, tokens: array[int]) -> bytes:
    """The Python path's /query answer: HotPath's, for a body that is not the plain one."""
    hot = SimpleNamespace(service=SimpleNamespace(router=router))
    return HotPath._query_answer(hot, tokens, TokensBody())  # type: ignore[arg-type]


def _native_query(router: Router, tokens: array[int]) -> bytes | None:
    hot = SimpleNamespace(service=SimpleNamespace(router=router))
    answered = router.native.answered
    answer = HotPath._query_answer(hot, tokens, PLAIN_BODY)  # type: ignore[arg-type]
    return answer if router.native.answered > answered else None


def _python_answer(router: Router, tokens: array[int]) -> bytes | None:
    """The Python path's answer; None when no holder is available (a 503)."""
    try:
        return encode_route_answer(router.route(tokens, top=4), recorded=False, top=4)
    except RouterNotReadyError:
        return None


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(fleets(), st.booleans(), st.lists(st.integers(0, 3), max_size=3))
def test_the_native_answer_is_the_python_answer(
    case: dict, predicting: bool, recorded: list[int]
) -> None:
    """Predictions (made by recorded requests) count alike."""
    tokens = array("I", case["request"])
    fast, slow = _predicting_fleets(case, predicting, recorded)
    # the first request after the loads changed is answered in one pass, the second
    # makes the ranking the native call plans from
    for router in (fast, slow):
        _python_answer(router, tokens)
        _python_answer(router, tokens)
        assert router._kept_ranking(router.holders()) is not None
    lookups = fast.index.stats.lookups
    got = fast.native.answer(tokens)
    expected = _python_answer(slow, tokens)
    event("no holder available" if expected is None else "answered")
    if expected is not None and b'"predicted_blocks":0,' not in expected:
        event("answered with predicted blocks")
    if expected is None:
        assert got is None  # no holder can take it: the Python path says so
        return
    assert got == expected
    assert fast.native.answer(tokens) == got  # the kept plan answers again alike
    assert _python_answer(slow, tokens) == got
    # recorded as the Python match records it: a lookup each (two requests on each
    # router since ``lookups``), the same blocks touched
    assert fast.index.stats.lookups == slow.index.stats.lookups == lookups + 2
    fast.index._flush_touches()
    slow.index._flush_touches()
    assert list(fast.index._blocks) == list(slow.index._blocks)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(fleets(), st.booleans(), st.lists(st.integers(0, 3), max_size=3))
def test_the_native_query_is_the_python_query(
    case: dict, predicting: bool, recorded: list[int]
) -> None:
    tokens = array("I", case["request"])
    fast, slow = _predicting_fleets(case, predicting, recorded)
    lookups = fast.index.stats.lookups
    got = _native_query(fast, tokens)
    assert got is not None  # /query needs no ranking and no available holder
    assert got == _python_query(slow, tokens)
    if b'"predicted_blocks"' in got:
        event("answered with predicted blocks")
    assert fast.index.stats.lookups == slow.index.stats.lookups == lookups + 1
    fast.index._flush_touches()
    slow.index._flush_touches()
    assert list(fast.index._blocks) == list(slow.index._blocks)


def _routed(router: Router, tokens: array[int], top: int = 1) -> RouteDecision | None:
    """``route(top=...)``: 1 is a relayed request's call, 4 a recorded /route's; None
    when no holder is available."""
    try:
        return router.route(tokens, top=top)
    except RouterNotReadyError:
        return None


def _seen(decision: RouteDecision) -> bytes:
    """Every field of a decision, exactly (floats as written: -0.0 is not 0.0)."""
    return msgspec.json.encode(msgspec.structs.replace(decision, keys=list(decision.keys)))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    fleets(),
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.booleans(),
            st.sampled_from([0.0, 0.5, 1.5]),
            st.sampled_from([1, 1, 2, 4, 16]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_the_native_choice_over_the_board_is_the_python_choice(
    case: dict, relayed: list[tuple[int, bool, float, int]], predicting: bool
) -> None:
    """Relayed requests (top 1) and recorded /route ones (the best few), each one
    changing the loads (begun, sometimes ended), are routed alike natively and in
    Python, predictions counted (made by the requests begun, expiring on a clock both
    routers share), and their matches recorded alike."""
    now = [0.0]
    clock = (lambda: now[0]) if predicting else None
    fast, slow = _fleet(case, natively=True, clock=clock), _fleet(case, natively=False, clock=clock)
    lookups = fast.index.stats.lookups
    asked = [
        (case["request"], False, 0.0, 1),
        *((case["prompts"][i], e, t, top) for i, e, t, top in relayed),
    ]
    for prompt, end, later, top in asked:
        now[0] += later  # some predictions expire (2 s)
        tokens = array("I", prompt)
        got, expected = _routed(fast, tokens, top), _routed(slow, tokens, top)
        if expected is None:
            assert got is None  # no holder can take it: the Python path says so
            continue
        assert got is not None and _seen(got) == _seen(expected)
        tickets = fast.begin(got), slow.begin(expected)
        if end:
            fast.finish(tickets[0])
            slow.finish(tickets[1])
    event("chosen natively" if fast.native.chosen else "not plain: Python chose")
    if fast.index._predicted:
        event("predictions held at the end")
    if any(fast.routes) and fast.decided_by_prediction:
        event("a holder chosen by prediction")
    assert fast.index.stats.lookups - lookups == slow.index.stats.lookups - lookups
    assert fast.index._predicted == slow.index._predicted
    assert fast.index.predictions.stats == slow.index.predictions.stats
    assert fast.decided_by_prediction == slow.decided_by_prediction
    fast.index._flush_touches()
    slow.index._flush_touches()
    assert list(fast.index._blocks) == list(slow.index._blocks)
    assert {h: fast.loads[h] for h in fast.loads} == {h: slow.loads[h] for h in slow.loads}


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    fleets(),
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.sampled_from(["open", "answered", "failed"]),
            st.sampled_from([0.0, 0.05, 0.3, 1.5]),
            st.sampled_from([1, 1, 4, 16]),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_stalled_holders_are_chosen_alike_natively_and_in_python(
    case: dict, relayed: list[tuple[int, str, float, int]]
) -> None:
    """With stalls watched on a clock both routers share, requests left in flight stall
    their holders and answered ones end the stalls, and the native and the Python choice
    agree throughout, also when every candidate is stalled or down."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    fast = _fleet(case, natively=True, clock=clock, stall_after_s=0.5)
    slow = _fleet(case, natively=False, clock=clock, stall_after_s=0.5)
    for which, end, later, top in relayed:
        now[0] += later
        tokens = array("I", case["prompts"][which])
        got, expected = _routed(fast, tokens, top), _routed(slow, tokens, top)
        if expected is None:
            assert got is None
            continue
        assert got is not None and _seen(got) == _seen(expected)
        tickets = fast.begin(got), slow.begin(expected)
        if end != "open":
            fast.finish(tickets[0], failed=end == "failed")
            slow.finish(tickets[1], failed=end == "failed")
        if fast.loads.any_stalled:
            event("a holder stalled")
    stalled = [fast.loads.stalled_by(h) for h in fast.loads]
    assert stalled == [slow.loads.stalled_by(h) for h in slow.loads]
    assert {h: fast.loads[h] for h in fast.loads} == {h: slow.loads[h] for h in slow.loads}


@pytest.mark.parametrize("listed", [1 << 16, 2], ids=["changes-synced", "mirror-rebuilt"])
def test_predictions_count_in_the_native_choice_as_in_python(
    listed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests of new prompts predict their blocks on the holder chosen: the next ones
    sharing a prefix follow the prediction, natively as in Python, whether the
    predictions' mirror syncs their listed changes or (more changes than listed between
    two choices) is rebuilt from the dict; expired and withdrawn predictions leave it."""
    monkeypatch.setattr(predictions_module, "_CHANGED_LIMIT", listed)
    now = [0.0]
    routers = []
    for natively in (True, False):
        router = Router(block_size=4, prediction_ttl_s=2.0, clock=lambda: now[0])
        if not natively:
            router.native._module = None
        for rank in range(4):
            router.add_holder(Holder("http://e", rank))
        routers.append(router)
    rng = random.Random(5)
    shared = [rng.getrandbits(32) for _ in range(40)]
    seen = []
    for i in range(40):
        tokens = array(
            "I", shared[: rng.randrange(4, 40)] + [rng.getrandbits(32) for _ in range(8)]
        )
        decisions = [r.route(tokens, top=1) for r in routers]
        assert _seen(decisions[0]) == _seen(decisions[1]), i
        seen.append(decisions[0].chosen.predicted_blocks)
        tickets = [r.begin(d) for r, d in zip(routers, decisions, strict=True)]
        if i % 3 == 0:  # the engine refused it: its predictions are withdrawn
            for r, t in zip(routers, tickets, strict=True):
                r.finish(t, failed=True)
        now[0] += 0.3 if i % 7 else 2.5  # some predictions expire
    fast, slow = routers
    assert fast.native.chosen == 40 and slow.native.chosen == 0
    assert any(seen), "some requests matched predicted blocks"
    assert fast.index._predicted == slow.index._predicted
    assert fast.index.predictions.stats == slow.index.predictions.stats
    assert fast.decided_by_prediction == slow.decided_by_prediction


def test_a_relayed_request_is_chosen_natively_and_each_change_of_loads_is_read() -> None:
    router, tokens = _plain_router()
    router.update_load("http://e", {"ranks": [{"dp_rank": 0, "running": 1}]})
    before = router.native.chosen
    first = router.route(tokens, top=1)
    assert router.native.chosen == before + 1
    assert (first.dp_rank, first.chosen.matched.gpu, first.n_blocks) == (1, 9, 10)
    assert list(first.keys) == content_keys_per_block(tokens, 4)
    # the holder of every block is busy now: the load read from the board moves the choice
    router.update_load("http://e", {"ranks": [{"dp_rank": 1, "running": 50, "waiting": 0}]})
    busy = router.route(tokens, top=1)
    assert router.native.chosen == before + 2
    assert busy.dp_rank not in (0, 1) and busy.chosen.pending_blocks == 0.0
    # the same loads again: the Python path builds its ranking, as before
    router.route(tokens, top=1)
    assert router.native.chosen == before + 2
    # a recorded /route asks for the best 4: chosen natively too, in order
    router.update_load("http://e", {"ranks": [{"dp_rank": 2, "running": 3}]})
    four = router.route(tokens, top=4)
    assert router.native.chosen == before + 3
    # rank 3 idle, then 0 and 2 (1 and 3 requests of the engine's own: 8 blocks each
    # pending), and last rank 1, which holds the prompt but has 50 requests queued
    assert [s.dp_rank for s in four.scores] == [3, 0, 2, 1] and four.dp_rank == 3


@pytest.mark.parametrize(
    "route",
    [
        pytest.param(lambda r, t: r.route(t, top=1, cache_salt="s"), id="salt"),
        pytest.param(lambda r, t: r.route(t, top=1, lora="a"), id="adapter"),
        pytest.param(lambda r, t: r.route(t, top=17), id="top-past-16"),
        pytest.param(lambda r, t: r.route(list(t), top=1), id="tokens-in-a-list"),
    ],
)
def test_what_the_native_choice_does_not_take_goes_to_python(
    route: Callable[[Router, array[int]], RouteDecision],
) -> None:
    router, tokens = _plain_router()
    router.update_load("http://e", {"ranks": [{"dp_rank": 0, "running": 1}]})
    before = router.native.chosen
    route(router, tokens)
    assert router.native.chosen == before


def test_a_weight_that_is_no_float_goes_to_python() -> None:
    router, tokens = _plain_router()
    router.weights = ScoringWeights(load_weight=1)
    router.update_load("http://e", {"ranks": [{"dp_rank": 0, "running": 1}]})
    before = router.native.chosen
    router.route(tokens, top=1)
    assert router.native.chosen == before


def _plain_router(holders: int = 4, block_size: int = 4) -> tuple[Router, array[int]]:
    router = Router(block_size=block_size, prediction_ttl_s=None)
    for rank in range(holders):
        router.add_holder(Holder("http://e", rank))
    tokens = array("I", range(10 * block_size))
    router.index.store_keys(Holder("http://e", 1), content_keys_per_block(tokens, block_size))
    router.route(tokens, top=4)
    router.route(tokens, top=4)  # the ranking is kept from here
    return router, tokens


def test_a_plain_fleet_is_answered_natively() -> None:
    router, tokens = _plain_router()
    answer = router.native.answer(tokens)
    assert answer is not None and router.native.answered == 1
    decoded = msgspec.json.decode(answer)
    assert (decoded["dp_rank"], decoded["n_blocks"], decoded["holders"]) == (1, 10, 4)
    assert decoded["scores"][0]["matched"] == {"gpu": 9, "cpu": 0, "disk": 0}


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda r, t: r.index.store_keys(Holder("http://e", 2), [5], tier=Tier.CPU),
            id="offloaded",
        ),
        pytest.param(
            lambda r, t: r.update_load("http://e", {"ranks": [{"dp_rank": 0, "running": 1}]}),
            id="loads-changed",
        ),
        pytest.param(lambda r, t: setattr(r.index, "block_size", 61), id="block-past-60"),
        pytest.param(lambda r, t: setattr(r.index, "credits", TierCredits(gpu=1)), id="int-credit"),
    ],
)
def test_what_the_native_call_does_not_take_goes_to_python(
    change: Callable[[Router, array[int]], object],
) -> None:
    router, tokens = _plain_router()
    change(router, tokens)
    assert router.native.answer(tokens) is None
    assert router.native.answered == 0


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda r: r.index.store_keys(Holder("http://e", 2), [5], tier=Tier.CPU),
            id="offloaded",
        ),
        pytest.param(lambda r: setattr(r.index, "block_size", 61), id="block-past-60"),
        pytest.param(lambda r: setattr(r.index, "block_size", None), id="no-block-size"),
    ],
)
def test_what_the_native_query_does_not_take_goes_to_python(
    change: Callable[[Router], object],
) -> None:
    router, tokens = _plain_router()
    change(router)
    assert router.native.query(tokens) is None


def test_a_query_of_a_fleet_of_65_slots_goes_to_python() -> None:
    router, tokens = _plain_router(holders=65)
    assert router.native.query(tokens) is None


def test_a_plan_is_made_again_for_other_credits_even_equal_ones() -> None:
    """Credits of 1 and of 1.0 are equal structs that write apart (an int cached count
    against a float): a plan made for one never answers for the other."""
    router, tokens = _plain_router()
    floats = router.index.credits = TierCredits(gpu=1.0, cpu=0.0, disk=0.0)
    assert router.native.answer(tokens) is not None  # a plan for float credits
    router.index.credits = TierCredits(gpu=1, cpu=0, disk=0)
    assert router.index.credits == floats
    assert router.native.answer(tokens) is None  # int credits: the Python path
    assert b'"cached_blocks":9,' in encode_route_answer(
        router.route(tokens, top=4), recorded=False, top=4
    )


def test_a_query_plan_is_made_again_for_an_equal_list_of_holders_in_other_slots() -> None:
    a, b, x = Holder("http://e", 0), Holder("http://e", 1), Holder("http://x", 0)
    router = Router(block_size=4, prediction_ttl_s=None)
    router.add_holder(a)
    router.add_holder(b)
    tokens = array("I", range(40))
    first = router.index.holders()
    assert _native_query(router, tokens) is not None  # a plan: a in slot 0, b in slot 1
    router.remove_holder(b)
    router.add_holder(x)  # slot 1
    router.add_holder(b)  # slot 2
    router.remove_holder(x)
    assert router.index.holders() == first and router.index.holders() is not first
    assert router.index.slot_of(b) == 2
    router.index.store_keys(b, content_keys_per_block(tokens, 4))
    got = _native_query(router, tokens)
    assert got is not None and got == _python_query(router, tokens)
    assert b'"dp_rank":1,"matched_blocks":9,' in got


def test_predictions_are_answered_natively_as_in_python() -> None:
    """A recorded request predicts its blocks on its holder: the next /route and /query
    of a request sharing them count the prediction, natively as in Python."""
    routers = []
    for natively in (True, False):
        router = Router(block_size=4, prediction_ttl_s=60.0)  # predictions on
        if not natively:
            router.native._module = None
        for rank in range(2):
            router.add_holder(Holder("http://e", rank))
        router.record(router.route(array("I", range(40))))
        routers.append(router)
    tokens = array("I", range(48))  # the 10 predicted blocks, and 2 more
    for router in routers:
        router.route(tokens, top=4)  # the loads changed: one pass
        router.route(tokens, top=4)  # the ranking is kept from here
    fast, slow = routers
    got = fast.native.answer(tokens)
    assert got is not None and got == _python_answer(slow, tokens)
    decoded = msgspec.json.decode(got)
    assert decoded["predicted_blocks"] == 10 and decoded["scores"][0]["predicted_blocks"] == 10
    query = _native_query(fast, tokens)
    assert query is not None and query == _python_query(slow, tokens)
    assert b'"predicted_blocks":10,"predicted_tokens":40}' in query


def test_more_than_64_slots_go_to_python() -> None:
    router, tokens = _plain_router(holders=65)
    assert router.native.answer(tokens) is None


def test_a_fleet_of_unavailable_holders_goes_to_python() -> None:
    router, tokens = _plain_router(holders=2)
    router.update_load(
        "http://e", {"ranks": [{"dp_rank": r, "available": False} for r in range(2)]}
    )
    for _ in range(2):
        with pytest.raises(RouterNotReadyError):
            router.route(tokens, top=4)
    assert router._kept_ranking(router.holders()) is not None
    assert router.native.answer(tokens) is None


def test_a_float_msgspec_writes_with_an_exponent_goes_to_python() -> None:
    """A cost from 1e16 on is written 1e16 by msgspec, 1e+16 by repr: not answered natively."""
    router, tokens = _plain_router(holders=2)
    router.update_load("http://e", {"ranks": [{"dp_rank": 0, "running": 10**17, "waiting": 0}]})
    router.route(tokens, top=4)
    router.route(tokens, top=4)
    assert router.native.answer(tokens) is None


def test_the_plan_packs_what_the_extension_reads() -> None:
    assert module is not None
    assert struct.calcsize("=dddqqq") == module.CANDIDATE_BYTES


def test_token_ids_not_in_a_uint32_array_are_keyed_in_python() -> None:
    """The extension hashes each token as 4 bytes: ids held wider (an ``array("q")``)
    are routed by the Python path, not reported as a failed native call."""
    router, tokens = _plain_router()
    router.update_load("http://e", {"ranks": [{"dp_rank": 0, "running": 1}]})
    before = router.native.chosen
    wide = array("q", tokens)
    decision = router.route(wide, top=1)
    assert decision.dp_rank == 1 and decision.chosen.matched.gpu == 9
    assert router.native.answer(wide) is None and router.native.query(wide) is None
    assert (router.native.chosen, router.native.failures) == (before, 0)


def test_an_extension_built_from_other_source_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place build left from another version (its calls take other arguments) is
    turned off with the reason, not called to fail on every request."""
    assert module is not None
    monkeypatch.setattr(native, "_status", native.status())
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(module, "ABI", native.ABI + 1)
    assert native.load() is None
    assert native.status().startswith("off: the built extension is of another version")
    monkeypatch.undo()
    assert native.load() is module and native.status() == "loaded"
