"""The cases scripts/fuzz-native runs in its sanitized process: every native entry point
against its Python path, on random and adversarial inputs.

Each case takes its own seeded ``random.Random`` (printed with a failure, so that one
case replays alone) and raises :class:`Mismatch` when the native answer differs from the
Python one, or when a bad argument is answered with anything but a clean ``TypeError``,
``ValueError`` or ``OverflowError`` (``MemoryError`` for sizes past memory). Memory errors
and undefined behaviour end the process through the sanitizers themselves.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import math
import random
import struct
import sys
import time
import traceback
from array import array
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

NAME = "kvevents.kernels._native"
CLEAN = (TypeError, ValueError, OverflowError, MemoryError)
U32, U64 = 2**32 - 1, 2**64 - 1


class Mismatch(AssertionError):
    """The native answer is not the Python path's (the message says which input)."""


def check(ok: bool, what: str, *given: object) -> None:
    if not ok:
        raise Mismatch(f"{what}: {given!r}"[:4000])


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", answer)`` or ``("raised", the exception's type)``; a type a bad argument
    must never raise is a mismatch."""
    try:
        return "ok", call()
    except CLEAN as exc:
        return "raised", type(exc)
    except Exception as exc:
        raise Mismatch(f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc


# --- token bodies ------------------------------------------------------------------

NUMBERS = ["0", "7", "12", "4294967295", "4294967296", "-1", "01", "1.0", "1e3", "1E+2",
           "0x10", "+1", "99999999999999999999", "1_0", "\u0661", "", " 5 ", "1234567",
           "12345678", "123456789", "-0", "3.", ".5"]  # fmt: skip
SEPARATORS = [",", ", ", " , ", ",\n\t", ",,", "", ";", ",\r\n "]
LEADS = [None, b'"prompt"', b'"model": "m", "prompt"', b'"input_ids"', b"", b'"inpu']
TAILS = [b"", b', "top": 2', b', "input_ids": [1]', b', "text": "x"', b', "record": true',
         b', "x": {"y": [1, {"z": null}]}', b', ', b',}', b' , "top": 2 ', b'}']  # fmt: skip


def an_id(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.6:
        return str(rng.choice([rng.randrange(10), rng.randrange(100_000), rng.getrandbits(32)]))
    if roll < 0.9:
        return str(rng.randrange(10 ** rng.randrange(1, 12)))
    return rng.choice(NUMBERS)


def a_body(rng: random.Random) -> bytes:
    """A body near the plain case: half of them plain, the rest broken on purpose."""
    space = lambda: rng.choice([b"", b"", b" ", b"\n", b"\t ", b"\r\n"])  # noqa: E731
    n = rng.randrange(0, 3000 if rng.random() < 0.1 else 40)
    if rng.random() < 0.5:  # plain: any ids of uint32, JSON's separators and whitespace
        ids = [
            rng.choice([rng.randrange(10), rng.randrange(10**6), rng.getrandbits(32)])
            for _ in range(n)
        ]
        sep = rng.choice([b",", b", ", b" ,", b",\n "])
        array_text = b"[" + space() + sep.join(b"%d" % i for i in ids) + space() + b"]"
        tail = rng.choice([b"", b', "top": 2', b', "record": true'])
        return space() + b'{"input_ids"' + space() + b":" + array_text + tail + b"}" + space()
    key = rng.choice(
        [b'"input_ids"', b'"input_ids"', b'"prompt"', b'"input_\\u0069ds"', b"input_ids"]
    )
    sep = rng.choice(SEPARATORS).encode()
    ids_text = sep.join(an_id(rng).encode() for _ in range(n))
    array_text = b"[" + space() + ids_text + space() + b"]"
    array_text = rng.choice([array_text] * 6 + [b"[[1]]", b'"1,2"', b"null", b"{}", b"[", b"[1"])
    body = space() + b"{" + space() + key + space() + b":" + space() + array_text
    body += space() + rng.choice(TAILS) + space() + b"}" + space()
    roll = rng.random()
    if roll < 0.15:  # truncated
        body = body[: rng.randrange(len(body) + 1)]
    elif roll < 0.3:  # one byte changed
        at = rng.randrange(len(body))
        body = body[:at] + bytes([rng.randrange(256)]) + body[at + 1 :]
    elif roll < 0.35:
        body = rng.randbytes(rng.randrange(40))
    elif roll < 0.4:  # a byte dropped or doubled
        at = rng.randrange(len(body))
        body = body[:at] + body[at + 1 :] if rng.random() < 0.5 else body[:at] + body[at:]
    return body


def parse_case(rng: random.Random, native: ModuleType) -> None:
    from kvevents.kernels import spec

    body = a_body(rng)
    lead = None if rng.random() < 0.5 else rng.choice(LEADS)
    given: Any = rng.choice([body, body, bytearray(body), memoryview(body)])
    got = outcome(lambda: native.parse_input_ids(given, lead))
    expected = spec.parse_input_ids(body, spec.INPUT_IDS if lead is None else lead)
    answer = got[1] if got[0] == "ok" else got
    check(
        (None if answer is None else (answer[0].tolist(), answer[1])) == expected,
        "parse_input_ids",
        body,
        lead,
        answer,
        expected,
    )
    if lead is None and rng.random() < 0.3:
        decode_alike(body)


def decode_alike(body: bytes) -> None:
    """The router's whole decode of ``body``, with the core and without: the same."""
    import msgspec

    from kvevents import kernels
    from kvevents.router.prompts.token_body import BadRequest, decode_tokens_body

    def decoded() -> tuple[str, object]:
        try:
            tokens, parsed = decode_tokens_body(body, chat=False)
        except BadRequest as exc:
            return "refused", str(exc)
        ids = None if tokens is None else list(tokens)  # the native path hands them apart
        return "decoded", (ids, msgspec.structs.replace(parsed, input_ids=None))

    with_core = decoded()
    kept, kernels._kernels = kernels._kernels, None
    try:
        without = decoded()
    finally:
        kernels._kernels = kept
    check(
        with_core == without,
        "decode_tokens_body with and without the core",
        body,
        with_core,
        without,
    )


# --- keys ----------------------------------------------------------------------------


def keys_case(rng: random.Random, native: ModuleType) -> None:
    from kvevents.wire.hashing import content_keys_per_block

    n = rng.choice([0, 1, 3, rng.randrange(200), rng.randrange(2000)])
    tokens = array("I", [rng.choice([0, U32, rng.getrandbits(32)]) for _ in range(n)])
    size = rng.choice([rng.randrange(1, 61), rng.randrange(1, 61), 0, -3, 61, 64, 2**62, "4"])
    parent = rng.choice([0, 1, U64, rng.getrandbits(64), -1, 2**64, 1.5])
    given: Any = rng.choice([tokens] * 5 + [tokens.tobytes(), array("Q", [1, 2]), list(tokens)])
    got = outcome(lambda: native.chain_keys(given, size, parent))
    if not isinstance(size, int) or not isinstance(parent, int):
        expected: Any = ("raised", TypeError)
    elif not 0 <= parent <= U64:
        expected = ("raised", OverflowError)
    elif size < 1:
        expected = ("raised", ValueError)
    elif size > 60:
        expected = ("ok", None)
    elif given is not tokens:
        expected = ("raised", TypeError)
    else:
        expected = ("ok", content_keys_per_block(tokens, size, parent))
    if got[0] == "ok" and got[1] is not None:
        got = ("ok", got[1].tolist())
    check(got == expected, "chain_keys", n, size, parent, type(given), got, expected)


# --- the mirror ------------------------------------------------------------------------


def _home(key: int) -> int:
    h = key * 0x9E3779B97F4A7C15 & U64
    return (h ^ h >> 32) & 4095


CROWDED: list[int] = []
"""Keys that share a few home slots of a new table: long probe runs, moved on delete."""


def crowded() -> list[int]:
    if not CROWDED:
        rng = random.Random(0)
        while len(CROWDED) < 64:
            key = rng.getrandbits(64)
            if _home(key) in (7, 8, 4095):
                CROWDED.append(key)
    return CROWDED


def mirror_case(rng: random.Random, native: ModuleType) -> None:
    from kvevents.kernels.spec import MirrorModel

    words = rng.choice([1, 1, 2, 3, 17])
    limit = 64 * words
    mirror, model = native.MaskMirror(words), MirrorModel(words)
    pool = crowded() + [rng.getrandbits(64) for _ in range(16)] + [0, U64]
    for _ in range(rng.randrange(1, 40)):
        roll = rng.random()
        before = sorted(mirror.items())
        if roll < 0.45:
            n = rng.choice([1, 5, 50, 3000 if rng.random() < 0.05 else 20])
            keys: list[Any] = [rng.choice(pool) for _ in range(n)]
            ops = array("q", [rng.randint(-limit, limit) for _ in range(n)])
            bad = rng.random() < 0.1
            if bad:  # one write out of range, or a key that is no uint64
                at = rng.randrange(n)
                if rng.random() < 0.5:
                    ops[at] = rng.choice([limit + 1, -limit - 1, 2**63 - 1, -(2**63)])
                else:
                    keys[at] = rng.choice([-1, 2**64, "k", None, 1.0])
            got = outcome(lambda keys=keys, ops=ops: mirror.sync(keys, ops))
            if bad:
                check(got[0] == "raised", "sync of a bad write", keys, list(ops), got)
                check(sorted(mirror.items()) == before, "a refused sync changed the table")
            else:
                check(got == ("ok", None), "sync", got)
                model.sync(keys, ops)
        elif roll < 0.5:
            blocks = {
                rng.choice(pool): rng.getrandbits(3 * limit) for _ in range(rng.randrange(60))
            }
            if rng.random() < 0.1:
                blocks[rng.choice(pool)] = rng.choice([-1, "x", 1.5])
                check(
                    outcome(lambda b=blocks: mirror.rebuild(b))[0] == "raised",
                    "rebuild of a bad mask",
                )
                check(sorted(mirror.items()) == before, "a refused rebuild changed the table")
            else:
                mirror.rebuild(blocks)
                model.rebuild(blocks)
        elif roll < 0.8:
            request = array("Q", [rng.choice(pool) for _ in range(rng.randrange(0, 80))])
            live = rng.choice([(1 << limit) - 1, rng.getrandbits(limit), 0, 1 << (limit - 1)])
            if rng.random() < 0.05:
                live = rng.choice([-1, 1 << limit, "x"])
                check(
                    outcome(lambda r=request, v=live: mirror.match(r, v))[0] == "raised",
                    "match, bad live",
                )
            else:
                got = mirror.match(request, live)
                check(got == model.match(request, live), "match", list(request), live, got)
        else:
            request = array("Q", [rng.choice(pool) for _ in range(rng.randrange(0, 40))])
            slot = rng.choice([0, limit - 1, rng.randrange(limit), -1, limit])
            got = outcome(lambda r=request, v=slot: mirror.not_held(r, v))
            if 0 <= slot < limit:
                check(got == ("ok", model.not_held(request, slot)), "not_held", slot, got)
            else:
                check(got == ("raised", ValueError), "not_held of a slot past the mirror", slot)
        check(sorted(mirror.items()) == sorted(model.masks.items()), "the mirror's keys")
        check(mirror.count == len(model.masks), "the mirror's count")


# --- the load scan ---------------------------------------------------------------------

SPECIAL = [0.0, -0.0, 1.0, 0.5, math.inf, -math.inf, math.nan, 1e300, 5e-324, -3.0]


def a_float(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.3:
        return rng.choice(SPECIAL)
    if roll < 0.6:
        return float(rng.randrange(20))
    return struct.unpack("<d", rng.randbytes(8))[0]


def scan_case(rng: random.Random, native: ModuleType) -> None:
    from kvevents.kernels import spec

    rows = rng.randrange(0, 12)
    table = array("d", [a_float(rng) for _ in range(6 * rows)])
    if rng.random() < 0.1:
        table.append(1.0)  # a partial row, never read
    slots = array("q", [rng.randrange(rows) for _ in range(rng.randrange(30))] if rows else [])
    bad = rng.random() < 0.1 and slots
    if bad:
        slots[rng.randrange(len(slots))] = rng.choice([-1, rows, 2**62, -(2**63)])
    figures = [a_float(rng) for _ in range(5)]
    count = rng.choice([0, 1, 4, 16, rng.randrange(40), 2**40])
    got = outcome(lambda: native.best_unmatched(slots, table, *figures, count))
    if bad:
        check(got == ("raised", ValueError), "best_unmatched of a slot past the table", got)
        return
    expected = spec.best_unmatched(slots, table, *figures, count)
    check(got[0] == "ok", "best_unmatched raised", got)
    picked, least = got[1]
    same_least = struct.pack("<d", least) == struct.pack("<d", expected[1])
    check(
        picked == expected[0] and same_least,
        "best_unmatched",
        list(slots),
        list(table),
        figures,
        count,
    )


# --- whole answers -----------------------------------------------------------------------

WORKERS = ["http://e0:8000", 'http://we"ird\\name', "http://\u00fcn\u00efcode\n"]


def routers(rng: random.Random) -> tuple[Any, Any, list[int], int]:
    """Two routers in the same random state, the first answering natively."""
    from kvevents import Holder, ScoringWeights, TierCredits
    from kvevents.errors import RouterNotReadyError
    from kvevents.router.decide.router import Router
    from kvevents.wire.hashing import content_keys_per_block

    block = rng.choice([1, 2, 3, 4, 16])
    count = rng.randrange(1, 10)
    holders = [Holder(WORKERS[i % 3], i // 3) for i in range(count)]
    prompts = [[rng.getrandbits(32) for _ in range(rng.randrange(12 * block))] for _ in range(3)]
    prompts.append(prompts[0] + [rng.randrange(50) for _ in range(rng.randrange(4 * block))])
    credits = rng.choice([TierCredits(), TierCredits(gpu=0.3), TierCredits(gpu=0.0)])
    weights = rng.choice([ScoringWeights(), ScoringWeights(load_weight=0.3, balance_weight=0.7)])
    predicting = rng.random() < 0.5
    made = []
    for natively in (True, False):
        router = Router(
            block_size=block,
            credits=credits,
            weights=weights,
            prediction_ttl_s=2.0 if predicting else None,
            clock=lambda: 0.0,
        )
        if not natively:
            router.native._module = None
        made.append(router)
    stored = [
        (rng.randrange(count), rng.randrange(4), rng.randrange(13)) for _ in range(rng.randrange(9))
    ]
    loads = [(rng.randrange(3), rng.randrange(count + 1), rng.randrange(4), rng.random() < 0.8)
             for _ in range(rng.randrange(4))]  # fmt: skip
    recorded = [rng.randrange(4) for _ in range(rng.randrange(4))]
    for router in made:
        for holder in holders:
            router.add_holder(holder)
        for who, which, blocks in stored:
            keys = content_keys_per_block(prompts[which][: blocks * block], block)
            router.index.store_keys(holders[who], keys)
        for worker, rank, running, available in loads:
            body = {"ranks": [{"dp_rank": rank, "running": running, "available": available}]}
            router.update_load(WORKERS[worker], body)
        for which in recorded:
            with contextlib.suppress(RouterNotReadyError):
                router.record(router.route(array("I", prompts[which]), top=1))
    request = rng.choice(prompts)
    return made[0], made[1], request[: rng.randrange(len(request) + 1)], block


def route_case(rng: random.Random, native: ModuleType) -> None:
    from types import SimpleNamespace

    import msgspec

    from kvevents.errors import RouterNotReadyError
    from kvevents.router.prompts.token_body import PLAIN_BODY, TokensBody
    from kvevents.router.serve.hot_path import HotPath, encode_route_answer

    fast, slow, prompt, _ = routers(rng)
    tokens = array("I", prompt)

    def python_route(router: Any, top: int) -> bytes | None:
        try:
            decision = router.route(tokens, top=top)
        except RouterNotReadyError:
            return None
        return msgspec.json.encode(msgspec.structs.replace(decision, keys=list(decision.keys)))

    roll = rng.random()
    if roll < 0.4:  # /route: twice in Python (the second makes the ranking), then natively
        for router in (fast, slow):
            for _ in range(2):
                with contextlib.suppress(RouterNotReadyError):
                    router.route(tokens, top=4)
        got = fast.native.answer(tokens)
        try:
            expected = encode_route_answer(slow.route(tokens, top=4), recorded=False, top=4)
        except RouterNotReadyError:
            expected = None
        check(got is None or got == expected, "route_answer", prompt, got, expected)
    elif roll < 0.7:  # /query
        answers = []
        for router, body in ((fast, PLAIN_BODY), (slow, TokensBody())):
            hot = SimpleNamespace(service=SimpleNamespace(router=router))
            answers.append(HotPath._query_answer(hot, tokens, body))  # type: ignore[arg-type]
        check(answers[0] == answers[1], "query_answer", prompt, *answers)
    else:  # a relayed or recorded request's choice, the loads changed before it
        top = rng.choice([1, 1, 4, 16])
        got, expected = python_route(fast, top), python_route(slow, top)
        check(got == expected, "board_choice", prompt, top, got, expected)


GARBAGE: list[Any] = [None, 0, -1, 2**64, 2**70, 1.5, math.nan, "x", b"", b"\0" * 7, (), [], {}]


def bad_calls_case(rng: random.Random, native: ModuleType) -> None:
    """The whole-request calls given arguments of every wrong kind, or right in kind and
    random in content: they answer or refuse cleanly, and an answer has its shape."""
    fast, _, prompt, block = routers(rng)
    index = fast.index
    mirror = index._synced_mirror()
    tokens = array("I", prompt)
    count = max(1, len(index.holders()))
    numbers = rng.randbytes(native.CANDIDATE_BYTES * count)
    fragments = tuple(rng.randbytes(rng.randrange(8)) for _ in range(native.FRAGMENTS * count))
    plan = (
        numbers,
        fragments,
        a_float(rng),
        a_float(rng),
        a_float(rng),
        rng.randbytes(5),
        a_float(rng),
    )
    query_plan = (
        array("q", [rng.randrange(-2, 70) for _ in range(count)]).tobytes(),
        fragments[:count],
        b"",
    )
    board = array("d", [a_float(rng) for _ in range(6 * rng.randrange(1, 5))])
    seats = array("q", [rng.randrange(-1, 5) for _ in range(2 * count)]).tobytes()
    weights = tuple(a_float(rng) for _ in range(7))
    other = native.MaskMirror(2)
    route_args = [tokens, block, rng.getrandbits(64), mirror, index._live, plan, rng.choice([-5, 0, 1, 4, 64, 65, 2**62]), rng.choice([None, mirror])]  # fmt: skip
    query_args = [
        tokens,
        block,
        0,
        mirror,
        index._live,
        query_plan,
        rng.choice([None, mirror, other]),
    ]
    choice_args = [tokens, block, 0, mirror, index._live, board, seats, a_float(rng), weights, None, rng.choice([0, 1, 16, 64, 65])]  # fmt: skip
    for call, args in ((native.route_answer, route_args), (native.query_answer, query_args),
                       (native.board_choice, choice_args)):  # fmt: skip
        args = list(args)
        for _ in range(rng.choice([0, 0, 1, 2])):
            roll = rng.random()
            if roll < 0.1 and args:
                args.pop(rng.randrange(len(args)))
            elif roll < 0.2:
                args.append(rng.choice(GARBAGE))
            else:
                at = rng.randrange(len(args))
                args[at] = rng.choice([*GARBAGE, other, tokens.tobytes(), array("Q", [1, 2, 3])])
        got = outcome(lambda call=call, args=args: call(*args))
        if got[0] == "ok":  # (answer, keys, longest), or (keys, longest, by_prediction, scores)
            keys = got[1][0 if call is native.board_choice else 1]
            check(isinstance(got[1], tuple) and isinstance(keys, bytes), "an answer's shape", got)


def float_case(rng: random.Random, native: ModuleType) -> None:
    import msgspec

    x = a_float(rng)
    written = native.json_float(x)
    if written is not None:
        check(written == msgspec.json.encode(x), "json_float", x, written)
    else:
        check(not (x == 0.0 or 1e-4 <= abs(x) < 1e16), "json_float refused a float it writes", x)


CASES = [
    parse_case,
    parse_case,
    keys_case,
    mirror_case,
    scan_case,
    route_case,
    bad_calls_case,
    float_case,
]


def load(built: Path) -> ModuleType:
    """The sanitized extension, installed as kvevents' own before kvevents is imported."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(built))
    spec = importlib.util.spec_from_file_location(NAME, built, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[NAME] = module
    return module


def run(built: Path, seconds: float, seed: int) -> int:
    """Fuzz for ``seconds``; 0 when nothing was found, 1 for a mismatch."""
    native = load(built)
    with open("/proc/self/maps") as maps:  # a run without its sanitizers would prove nothing
        if "libasan" not in maps.read():
            print("fuzz-native: AddressSanitizer is not loaded in the fuzzing process")
            return 1
    from kvevents import kernels

    if kernels.loaded() is not native:
        print(f"fuzz-native: the sanitized core is not the one loaded: {kernels.status()}")
        return 1
    rng = random.Random(seed)
    done: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < deadline:
        case = CASES[turn % len(CASES)]
        turn += 1
        case_seed = rng.getrandbits(64)
        try:
            case(random.Random(case_seed), native)
        except Mismatch as exc:
            print(f"fuzz-native: MISMATCH in {case.__name__} (case seed {case_seed}): {exc}")
            return 1
        done[case.__name__] += 1
    calls = ", ".join(f"{k} {v}" for k, v in native.calls().items())
    cases = ", ".join(f"{k} {v}" for k, v in sorted(done.items()))
    print(f"fuzz-native: passed: {sum(done.values())} cases ({cases}); native calls: {calls}")
    return 0
