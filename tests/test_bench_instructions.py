"""The instruction-count benchmark: its cases do the router's real work, and its figures
are the difference of two counted runs per case (the counter injected: valgrind is not
needed to check the arithmetic, only to measure)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from kvevents import kernels
from kvevents.bench import instructions
from kvevents.bench.instruction_cases import CASES, Cases, build_cases, main
from kvevents.bench.report import headlines
from kvevents.errors import KVEventsError


@pytest.fixture(scope="module")
def cases() -> Cases:
    assert kernels.load() is not None, kernels.status()
    return build_cases()


def test_the_relay_case_routes_each_prompt_to_the_rank_that_holds_it(cases: Cases) -> None:
    """Prompt i is stored on rank i mod 4; the relayed completion goes there, the rank
    appended to the body the engine gets."""

    async def relay(i: int) -> bytes:
        await cases.run["relay"](i)
        assert cases.router_engine.last is not None
        path, body, _ = cases.router_engine.last
        assert path == "/v1/completions"
        return body

    for i in range(8):
        body = msgspec.json.decode(asyncio.run(relay(i)))
        assert body["routed_dp_rank"] == i % 4
        assert len(body["prompt"]) == 2048


def test_every_case_answers_and_the_router_keeps_no_request_in_flight(cases: Cases) -> None:
    """Each case's request is answered 200 (a case raises otherwise), and a relayed
    request ends: nothing stays in flight on any holder."""

    async def each() -> None:
        for name in CASES:
            for i in range(4):
                await cases.run[name](i)

    asyncio.run(each())
    loads = cases.service.router.loads.values()
    assert [load.inflight_requests for load in loads] == [0, 0, 0, 0]
    assert cases.bare_engine.forwarded >= 4


def test_the_case_runner_refuses_what_it_does_not_know() -> None:
    """An unknown case or a request count that is not a number is a usage error (2)."""
    assert main(["nope", "5"]) == 2
    assert main(["route", "five"]) == 2


def test_per_request_figures_are_the_difference_of_two_counted_runs() -> None:
    """With 0 requests a case counts its start-up only; the figure is what N more add, over N."""
    cost = {"bare": 100, "route": 250, "query": 240, "bare_relay": 150, "relay": 330}
    calls: list[tuple[str, int]] = []

    def count(case: str, requests: int) -> int:
        calls.append((case, requests))
        return 7_000_000 + cost[case] * requests

    result = instructions.run_instructions_bench(requests=40, count=count)
    assert result["instructions_per_request"] == cost
    assert result["router_adds"] == {"route": 150, "relay": 180}
    assert calls[:3] == [("bare", 0), ("bare", 0), ("bare", 40)]  # compile, idle, served
    rows = {f.what: f.measured for f in headlines({"instructions": result})}
    assert rows["router /route"] == "250 (+150; bare 40.0% of it)"


def test_bad_settings_and_a_missing_valgrind_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="unknown case"):
        instructions.run_instructions_bench(cases=("route", "nope"), count=lambda c, n: 0)
    with pytest.raises(ValueError, match="at least 1"):
        instructions.run_instructions_bench(requests=0, count=lambda c, n: 0)
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    with pytest.raises(KVEventsError, match="apt-get install valgrind"):
        instructions.callgrind_count("bare", 1)


@pytest.mark.slow
def test_the_counted_run_has_one_blas_thread_and_a_fixed_hash_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NumPy's idle BLAS threads wake up in proportion to wall time: counted, they moved
    the bare case by about 5% from run to run. callgrind_count runs its process with one
    BLAS thread and a fixed hash seed, and reads callgrind's total from its stderr; a
    failed run is an error quoting that stderr."""
    fake = tmp_path / "valgrind"
    fake.write_text(
        '#!/bin/sh\necho "==1== Collected : ${OPENBLAS_NUM_THREADS:-x}0${PYTHONHASHSEED:-x}" >&2\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    monkeypatch.setattr(instructions.shutil, "which", lambda name: str(fake))
    assert instructions.callgrind_count("bare", 1) == 100  # "1" "0" "0"
    fake.write_text("#!/bin/sh\necho 'valgrind: out of memory' >&2\nexit 3\n")
    with pytest.raises(KVEventsError, match=r"exit 3.*out of memory"):
        instructions.callgrind_count("bare", 1)
