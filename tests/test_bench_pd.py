"""The router benchmark's disaggregated (P/D) case: its clients, its options, its headline,
and ``kvevents bench router --pd-only --quick`` end to end.

The clients run against scripted engines (plain asyncio servers on loopback answering
fixed bodies and recording what they got), so the legs' bodies are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvevents.bench.pd_load import (
    ROOM_PLACEHOLDER,
    DirectLegs,
    ViaRouter,
    VllmDirectLegs,
    run_load,
)
from kvevents.bench.pd_router import TYPICAL_ANSWER_TOKENS
from kvevents.bench.report import headlines
from kvevents.cli.main import main
from kvevents.router.serve.pd_legs import vllm_prefill_body
from kvevents.traces import iter_trace

BODIES = [{"model": "sim", "prompt": [1, 2, 3], "max_tokens": 1}, {"model": "sim", "prompt": [4]}]


async def _engine(
    status: int,
    seen: list[tuple[str, dict[str, Any]]],
    answer: bytes = b"{}",
    ranks: list[bytes] | None = None,
) -> tuple[str, Any]:
    """A server answering every POST with ``status`` and ``answer``, recording (path,
    body), and each request's ``x-data-parallel-rank`` header in ``ranks``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.lower().split(b"\r\n")
                length = next(
                    int(ln.split(b":")[1]) for ln in lines if ln.startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                seen.append((lines[0].split()[1].decode(), json.loads(body)))
                if ranks is not None:
                    rank = b"x-data-parallel-rank:"
                    ranks.extend(ln[len(rank) :].strip() for ln in lines if ln.startswith(rank))
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(answer), answer)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server


def test_direct_legs_carry_one_fresh_room_and_the_fixed_ranks() -> None:
    """The direct client sends each body as SGLang's two legs at once: the prefill's
    bootstrap host and port, the same fresh room on both (never the placeholder), the
    fixed ranks, no stream on the prefill leg."""
    prefill_seen: list[tuple[str, dict[str, Any]]] = []
    decode_seen: list[tuple[str, dict[str, Any]]] = []

    async def go() -> dict[str, Any]:
        prefill_url, prefill = await _engine(200, prefill_seen)
        decode_url, decode = await _engine(200, decode_seen)
        try:
            send = DirectLegs(prefill_url, decode_url, ("10.0.0.7", 8998), BODIES, ranks=(1, 2))
            result = await run_load(send, connections=2, duration=0.3, warmup=0.05)
            await asyncio.sleep(0.1)  # the last prefill answers, read behind the decode's
            assert send.prefill_failures == 0
            return result
        finally:
            prefill.close()
            decode.close()

    result = asyncio.run(go())
    assert result["requests"] > 0 and result["errors"] == 0
    assert len(prefill_seen) == len(decode_seen) == result["requests_all"]
    rooms = set()
    for (p_path, p), (d_path, d) in zip(
        sorted(prefill_seen, key=lambda s: s[1]["bootstrap_room"]),
        sorted(decode_seen, key=lambda s: s[1]["bootstrap_room"]),
        strict=True,
    ):
        assert p_path == d_path == "/v1/completions"
        assert p["bootstrap_room"] == d["bootstrap_room"] != ROOM_PLACEHOLDER
        rooms.add(p["bootstrap_room"])
        assert (p["bootstrap_host"], p["bootstrap_port"]) == ("10.0.0.7", 8998)
        assert p["routed_dp_rank"] == 1 and p["stream"] is False
        assert d["routed_dp_rank"] == 2 and d["disagg_prefill_dp_rank"] == 1
        assert p["prompt"] == d["prompt"] and p["prompt"] in ([1, 2, 3], [4])
    assert len(rooms) == len(prefill_seen)


def test_vllm_direct_legs_send_the_prefill_then_the_decode_with_its_parameters() -> None:
    """The vLLM client sends the prefill leg as the router builds it (one token, no
    stream, a remote decode asked), then the client's body with the parameters the
    prefill answered; each leg's rank is its X-data-parallel-rank header."""
    prefill_seen: list[tuple[str, dict[str, Any]]] = []
    decode_seen: list[tuple[str, dict[str, Any]]] = []
    prefill_ranks: list[bytes] = []
    decode_ranks: list[bytes] = []
    params = {"remote_host": "10.0.0.9", "remote_block_ids": [1, 2], "do_remote_prefill": True}

    async def go() -> tuple[dict[str, Any], VllmDirectLegs]:
        answer = json.dumps({"choices": [], "kv_transfer_params": params}).encode()
        prefill_url, prefill = await _engine(200, prefill_seen, answer, prefill_ranks)
        decode_url, decode = await _engine(200, decode_seen, ranks=decode_ranks)
        try:
            send = VllmDirectLegs(prefill_url, decode_url, BODIES, ranks=(1, 3))
            return await run_load(send, connections=2, duration=0.3, warmup=0.05), send
        finally:
            prefill.close()
            decode.close()

    result, send = asyncio.run(go())
    assert result["requests"] > 0 and result["errors"] == 0 and send.prefill_failures == 0
    assert len(prefill_seen) == len(decode_seen) == result["requests_all"]
    for (_, prefill), (_, decode) in zip(prefill_seen, decode_seen, strict=True):
        assert prefill in [vllm_prefill_body(b) for b in BODIES]
        assert decode in [{**b, "kv_transfer_params": params} for b in BODIES]
    assert set(prefill_ranks) == {b"1"} and set(decode_ranks) == {b"3"}
    assert len(prefill_ranks) == len(prefill_seen)


@pytest.mark.parametrize(("status", "answer"), [(500, b"{}"), (200, b"{not json")])
def test_a_vllm_prefill_that_fails_is_counted_and_no_decode_is_sent(
    status: int, answer: bytes
) -> None:
    """A prefill answering an error, or a 200 that is not JSON, fails the request and
    sends no decode leg, as the router would not."""
    decode_seen: list[tuple[str, dict[str, Any]]] = []

    async def go() -> tuple[dict[str, Any], int]:
        prefill_url, prefill = await _engine(status, [], answer)
        decode_url, decode = await _engine(200, decode_seen)
        try:
            send = VllmDirectLegs(prefill_url, decode_url, BODIES)
            run = await run_load(send, connections=1, duration=0.2, warmup=0.0)
            return run, send.prefill_failures
        finally:
            prefill.close()
            decode.close()

    result, failures = asyncio.run(go())
    assert result["errors"] == result["requests"] > 0 and failures == result["requests_all"]
    assert decode_seen == []


def test_the_router_client_sends_the_bodies_as_they_are_and_counts_errors() -> None:
    """The router's client posts each body unchanged; answers other than 200 are errors."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def go(status: int) -> dict[str, Any]:
        url, server = await _engine(status, seen)
        try:
            return await run_load(ViaRouter(url, BODIES), connections=2, duration=0.2, warmup=0.0)
        finally:
            server.close()

    ok = asyncio.run(go(200))
    assert ok["requests"] > 0 and ok["errors"] == 0
    assert all(path == "/v1/completions" and body in BODIES for path, body in seen)
    failing = asyncio.run(go(502))
    assert failing["requests"] > 0 and failing["errors"] == failing["requests"]


def test_the_default_answer_length_is_the_traces_median() -> None:
    """What a P/D bench request decodes unless told is the bundled trace's median answer."""
    lengths = [request.output_length for request in iter_trace()]
    assert statistics.median(lengths) == TYPICAL_ANSWER_TOKENS


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "index", "--pd-only"], "--pd-only is an option of `kvevents bench router`"),
        (
            ["bench", "router", "--pd-only", "--completions-only"],
            "--completions-only and --pd-only each run one comparison alone",
        ),
        (["bench", "router", "--pd-only", "--rounds", "0"], "--rounds 0: give at least 1"),
        (
            ["bench", "router", "--pin-router"],
            "--pin-router is an option of `kvevents bench router --pd-only`",
        ),
        (
            ["bench", "router", "--completions-only", "--pd-protocol", "vllm"],
            "--pd-protocol is an option of `kvevents bench router --pd-only`",
        ),
        (
            ["bench", "router", "--pd-max-tokens", "8"],
            "--pd-max-tokens is an option of `kvevents bench router --pd-only`",
        ),
        (
            ["bench", "router", "--pd-only", "--pd-max-tokens", "0"],
            "--pd-max-tokens 0: give at least 1",
        ),
        (
            ["bench", "router", "--no-pd-together"],
            "--pd-together is an option of `kvevents bench router --pd-only`",
        ),
    ],
)
def test_bad_pd_bench_options_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--pd-only elsewhere than router, with --completions-only, or with no rounds, and the
    P/D options without --pd-only, are refused with exit code 2 and a message naming the
    option, before anything runs."""
    assert main([*argv, "--json", str(tmp_path / "out.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(("added", "met"), [([3.0, 1.5, -0.5], True), ([2.5, 4.0, 1.0], False)])
def test_the_pd_headline_reports_the_median_against_two_ms(added: list[float], met: bool) -> None:
    """The P/D headline shows the median of the rounds' added p50s and is met at +2 ms or less."""
    rounds = [
        {
            "direct": {"p50_ms": 40.0},
            "via": {"p50_ms": 40.0 + a, "router_cpu_us_per_request": 600.0},
        }
        for a in added
    ]
    pd = {
        "setup": {"connections": 32},
        "rounds": rounds,
        "added_p50_ms": added,
        "added_p50_ms_median": sorted(added)[1],
    }
    rows = [f for f in headlines({"router": {"runs": {}, "pd": pd}}) if f.what.startswith("P/D")]
    assert len(rows) == 1 and rows[0].met is met and rows[0].target == "<= +2 ms"
    assert (
        rows[0].measured.startswith(f"{sorted(added)[1]:+.1f} ms") and "600 us" in rows[0].measured
    )


def test_the_pd_headline_says_the_spread_the_placement_and_what_was_checked() -> None:
    """The row names the protocol and where each process ran (pinned: the CPUs, and the
    client's and engines' CPU per request on both paths), the rounds' range, and is
    checked against the target the results carry."""
    rounds = [
        {
            "direct": {"p50_ms": 80.0, **_cpu(150, 900, 900)},
            "via": {"p50_ms": 80.0 + a, "router_cpu_us_per_request": c, **_cpu(70, 850, 880)},
        }
        for a, c in ((-3.0, 400.0), (1.0, 380.0), (2.5, 420.0))
    ]
    placement = {
        "pinned": True,
        "router_cpus": [3],
        "client_and_engine_cpus": [0, 1, 2],
        "read_back": {},
    }
    pd = {
        "setup": {"connections": 32, "protocol": "vllm", "placement": placement},
        "rounds": rounds,
        "added_p50_ms": [-3.0, 1.0, 2.5],
        "added_p50_ms_median": 1.0,
        "target": {"added_p50_ms_at_most": 2.0},
    }
    (row,) = [f for f in headlines({"router": {"runs": {}, "pd": pd}}) if f.what.startswith("P/D")]
    assert "vLLM legs in turn" in row.what
    assert "router pinned to CPU 3, client and engines to CPUs 0-2" in row.what
    assert "rounds -3.0 to +2.5: -3.0, +1.0, +2.5" in row.measured
    assert "router CPU 400 us per request (380-420)" in row.measured
    assert "client and engines' CPU per request 1950 direct, 1800 via" in row.measured
    assert row.met is True
    unpinned = {**pd, "setup": {**pd["setup"], "placement": {"pinned": False}}}
    (row,) = [f for f in headlines({"router": {"runs": {}, "pd": unpinned}}) if "P/D" in f.what]
    assert "unpinned: router, engines and client share every CPU" in row.what
    # the router's own too: it is taken from the same CPUs (its direct-path CPU unknown)
    assert "all processes'" not in row.measured
    for r in rounds:
        r["direct"]["router_cpu_us_per_request"] = 10.0
    (row,) = [f for f in headlines({"router": {"runs": {}, "pd": unpinned}}) if "P/D" in f.what]
    assert "all processes' CPU per request 1960 direct, 2200 via" in row.measured


def _cpu(client: float, prefill: float, decode: float) -> dict[str, float]:
    return {
        "client_cpu_us_per_request": client,
        "prefill_cpu_us_per_request": prefill,
        "decode_cpu_us_per_request": decode,
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pd_only_quick_runs_both_clients_against_real_engines(tmp_path: Path) -> None:
    """`kvevents bench router --pd-only --quick --pd-max-tokens 4` starts a prefill and a
    decode engine and a router, runs one round of both clients with no errors, each request
    decoding 4 tokens, and writes the comparison."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "bench", "router", "--pd-only", "--quick",
         "--pd-max-tokens", "4", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == {}
    router = doc["results"]["router"]
    pd = router["pd"]
    assert pd["setup"]["protocol"] == "sglang" and pd["setup"]["connections"] == 32
    assert pd["setup"]["max_tokens"] == 4 and "--pd-max-tokens 4" in doc["command"]
    assert len(pd["rounds"]) == 1 and pd["direct_prefill_failures"] == 0
    for side in ("direct", "via"):
        run = pd["rounds"][0][side]
        assert run["requests"] > 0 and run["errors_all"] == 0 and run["p50_ms"] > 0
    assert pd["rounds"][0]["via"]["router_cpu_us_per_request"] > 0
    assert router["summary"]["pd_added_p50_ms_median"] == pd["added_p50_ms_median"]
    assert router["runs"]["pd_direct"] == pd["rounds"][0]["direct"]
    assert "│ P/D " in proc.stdout  # the headline row (its text wraps in the table)
    assert pd["setup"]["placement"]["pinned"] is False
    assert pd["added_p50_ms_min"] == pd["added_p50_ms_max"] == pd["added_p50_ms_median"]
    assert pd["target"]["added_p50_ms_at_most"] == 2.0


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(
    len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2,
    reason="pinning needs two CPUs and Linux",
)
def test_pd_only_pinned_vllm_runs_with_the_router_on_its_own_cpu(tmp_path: Path) -> None:
    """`--pin-router --pd-protocol vllm`: vLLM's legs run through the router and directly
    with no errors, and the placement read back from every process is the split asked
    for: the router on the highest CPU, the client and both engines on the others."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "bench", "router", "--pd-only", "--quick",
         "--pin-router", "--pd-protocol", "vllm", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pd = json.loads(out.read_text())["results"]["router"]["pd"]
    assert pd["setup"]["protocol"] == "vllm" and pd["direct_prefill_failures"] == 0
    for side in ("direct", "via"):
        run = pd["rounds"][0][side]
        assert run["requests"] > 0 and run["errors_all"] == 0
    allowed = sorted(os.sched_getaffinity(0))
    placement = pd["setup"]["placement"]
    assert placement["pinned"] is True and placement["router_cpus"] == allowed[-1:]
    others = allowed[:-1]
    assert placement["read_back"] == {
        "router": allowed[-1:],
        "prefill": others,
        "decode": others,
        "client": others,
    }
    assert "pinned" in proc.stdout  # the headline row says where each process ran
