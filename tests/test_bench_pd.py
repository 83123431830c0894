"""The router benchmark's disaggregated (P/D) case: its clients, its options, its headline,
and ``kvevents bench router --pd-only --quick`` end to end.

The clients run against scripted engines (plain asyncio servers on loopback answering
fixed bodies and recording what they got), so the legs' bodies are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvevents.bench.pd_load import ROOM_PLACEHOLDER, DirectLegs, ViaRouter, run_load
from kvevents.bench.report import headlines
from kvevents.cli.main import main

BODIES = [{"model": "sim", "prompt": [1, 2, 3], "max_tokens": 1}, {"model": "sim", "prompt": [4]}]


async def _engine(status: int, seen: list[tuple[str, dict[str, Any]]]) -> tuple[str, Any]:
    """A server answering every POST with ``status`` and ``{}``, recording (path, body)."""

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
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 2\r\n\r\n{}" % status)
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "index", "--pd-only"], "--pd-only is an option of `kvevents bench router`"),
        (
            ["bench", "router", "--pd-only", "--completions-only"],
            "--completions-only and --pd-only each run one comparison alone",
        ),
        (["bench", "router", "--pd-only", "--rounds", "0"], "--rounds 0: give at least 1"),
    ],
)
def test_bad_pd_bench_options_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--pd-only elsewhere than router, with --completions-only, or with no rounds is refused
    with exit code 2 and a message naming the option, before anything runs."""
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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pd_only_quick_runs_both_clients_against_real_engines(tmp_path: Path) -> None:
    """`kvevents bench router --pd-only --quick` starts a prefill and a decode engine and a
    router, runs one round of both clients with no errors, and writes the comparison."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvevents.cli.main", "bench", "router", "--pd-only", "--quick",
         "--json", str(out)],
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
    assert len(pd["rounds"]) == 1 and pd["direct_prefill_failures"] == 0
    for side in ("direct", "via"):
        run = pd["rounds"][0][side]
        assert run["requests"] > 0 and run["errors_all"] == 0 and run["p50_ms"] > 0
    assert pd["rounds"][0]["via"]["router_cpu_us_per_request"] > 0
    assert router["summary"]["pd_added_p50_ms_median"] == pd["added_p50_ms_median"]
    assert router["runs"]["pd_direct"] == pd["rounds"][0]["direct"]
    assert "│ P/D " in proc.stdout  # the headline row (its text wraps in the table)
