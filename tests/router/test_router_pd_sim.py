"""Disaggregated serving end to end: `kvevents router --prefill --decode` in front of two
simulated engines, one started with ``--disaggregation-mode prefill``, one with ``decode``.

Real processes, real HTTP, real KV events: the prefill engine computes the prompt and
hands it over through its bootstrap server, the decode engine stores what it received
(publishing ``BlockStored``) and generates. The router indexes both pools' events, so
a prompt the decode now holds is served by the decode alone the next time, and a
prompt the prefill holds draws the prefill leg to that rank.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

BS = 4
pytestmark = pytest.mark.slow


def _engine(mode: str) -> Engine:
    args = ["--dp-size", "2", "--page-size", str(BS), "--disaggregation-mode", mode]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", "0"]
    return Engine([*args, "--disaggregation-timeout", "10"], KV_CONFIG)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    prefill = _engine("prefill")
    try:
        decode = _engine("decode")
        try:
            yield prefill, decode
        finally:
            decode.stop()
    finally:
        prefill.stop()


@contextlib.contextmanager
def pd_router(engines: tuple[Engine, Engine], *extra: str) -> Iterator[RouterProc]:
    prefill, decode = engines
    proc = RouterProc([], "--prefill", prefill.url, "--decode", decode.url, *extra)
    try:
        wait_until(lambda: proc.connected() == 4, 20, "the router to follow all four ranks")
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def sglang(engines: tuple[Engine, Engine]) -> Iterator[RouterProc]:
    with pd_router(engines, "--max-local-prefill-tokens", "16") as proc:
        yield proc


_counter = iter(range(1000, 10**6, 500))


def fresh_prompt(n: int = 40) -> list[int]:
    start = next(_counter)
    return list(range(start, start + n))


def holds(router: RouterProc, worker: str, tokens: list[int]) -> int | None:
    """The rank of ``worker`` the router sees holding every full block of ``tokens`` (asked
    with one token more, so that every full block is one an engine reuses)."""
    full = len(tokens) // BS * BS
    for m in router.post("/query", {"input_ids": [*tokens, 0]}).json()["matches"]:
        if m["worker"] == worker and m["matched_tokens"] == full:
            return int(m["dp_rank"])
    return None


def wait_held(router: RouterProc, worker: str, tokens: list[int]) -> int:
    found: list[int] = []

    def check() -> bool:
        rank = holds(router, worker, tokens)
        if rank is not None:
            found.append(rank)
        return rank is not None

    wait_until(check, 10, f"{worker} to hold the prompt in the router's index")
    return found[-1]


def sse(text: str) -> list[Any]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_a_completion_is_prefilled_handed_over_and_then_served_by_the_decode_alone(
    engines: tuple[Engine, Engine], sglang: RouterProc
) -> None:
    """The first time both legs run (the decode reports the received blocks it reuses as
    cached); the decode then publishes the blocks, so the same prompt goes to it alone."""
    prefill, decode = engines
    prompt = fresh_prompt()
    first = sglang.post("/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert first.status_code == 200, first.text
    assert first.headers["x-kvevents-prefill"] == "load"
    answer = first.json()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - BS
    assert answer["dp_rank"] == int(first.headers["x-kvevents-dp-rank"])
    rank = wait_held(sglang, decode.url, prompt)
    assert rank == answer["dp_rank"]
    assert holds(sglang, prefill.url, prompt) == int(first.headers["x-kvevents-prefill-dp-rank"])
    again = sglang.post("/v1/completions", {"prompt": [*prompt, 5, 6], "max_tokens": 3})
    assert again.status_code == 200, again.text
    assert again.headers["x-kvevents-prefill"] == "skipped"
    assert again.headers["x-kvevents-dp-rank"] == str(rank)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)


def test_a_streamed_completion_comes_from_the_decode(sglang: RouterProc) -> None:
    """A stream through both legs is the decode's tokens, relayed to [DONE]."""
    body = {"prompt": fresh_prompt(), "max_tokens": 4, "stream": True}
    response = sglang.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.headers["x-kvevents-prefill"] in ("load", "cache", "prediction")
    events = sse(response.text)
    assert len(events) == 4
    assert {e["dp_rank"] for e in events} == {int(response.headers["x-kvevents-dp-rank"])}


def test_generate_and_chat_go_through_both_legs(sglang: RouterProc) -> None:
    """/generate (token ids) and a chat are each prefilled, handed over and decoded."""
    prompt = fresh_prompt()
    generated = sglang.post("/generate", {"input_ids": prompt, "max_new_tokens": 2})
    assert generated.status_code == 200, generated.text
    answer = generated.json()
    assert answer["cached_tokens"] == len(prompt) - BS and answer["completion_tokens"] == 2
    assert answer["router"]["prefill_skipped"] is False
    assert answer["dp_rank"] == answer["router"]["decode"]["dp_rank"]
    messages = [{"role": "user", "content": "tell me about disaggregated serving " * 2}]
    chat = sglang.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert chat.headers["x-kvevents-prefill"] != "skipped"
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_batch_with_samples_goes_through_both_legs(sglang: RouterProc) -> None:
    """Two prompts with n=2: one room per prompt and sample, every one taken by the decode."""
    prompts = [fresh_prompt(), fresh_prompt()]
    response = sglang.post("/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.headers["x-kvevents-prefill"] != "skipped"
    assert len(response.json()["choices"]) >= 2


def test_the_prefill_follows_its_cache_when_the_decode_choice_changes(
    engines: tuple[Engine, Engine],
) -> None:
    """Sent twice, a prompt's second prefill goes to the prefill rank holding it (by
    cache), though the decode, whose copy was flushed, is chosen anew on another rank."""
    prefill, decode = engines
    with pd_router(engines, "--max-local-prefill-tokens", "0") as router:
        prompt = fresh_prompt(64)
        first = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert first.status_code == 200, first.text
        p_rank = int(first.headers["x-kvevents-prefill-dp-rank"])
        d_rank = int(first.headers["x-kvevents-dp-rank"])
        assert wait_held(router, prefill.url, prompt) == p_rank
        assert decode.http.post("/flush_cache").status_code == 200
        wait_until(lambda: holds(router, decode.url, prompt) is None, 10, "the decode's copy to go")
        second = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert second.status_code == 200, second.text
        assert int(second.headers["x-kvevents-dp-rank"]) != d_rank
        assert second.headers["x-kvevents-prefill"] == "cache"
        assert int(second.headers["x-kvevents-prefill-dp-rank"]) == p_rank


def test_the_vllm_protocol_drives_the_same_engines(engines: tuple[Engine, Engine]) -> None:
    """With --pd-protocol vllm the legs are sequential and the decode fetches the KV the
    prefill's kv_transfer_params name: completions, streamed and not, and a chat."""
    with pd_router(engines, "--pd-protocol", "vllm", "--max-local-prefill-tokens", "0") as router:
        prompt = fresh_prompt()
        whole = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - BS
        streamed = router.post(
            "/v1/completions", {"prompt": fresh_prompt(), "max_tokens": 2, "stream": True}
        )
        assert streamed.status_code == 200 and len(sse(streamed.text)) == 2
        messages = [{"role": "user", "content": "the other protocol " * 3}]
        chat = router.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        pd = router.http.get("/workers").json()["pd"]
        assert pd["protocol"] == "vllm" and pd["pools"]["prefill"]["requests"] == 3
        assert sum(pd["pools"]["decode"]["legs_failed"].values()) == 0


def test_several_router_processes_serve_pd_on_one_port(engines: tuple[Engine, Engine]) -> None:
    """With --workers 2 every router process serves P/D: both legs, then the decode alone;
    the group's /metrics sums their P/D counters."""
    decode = engines[1]
    with pd_router(engines, "--workers", "2", "--max-local-prefill-tokens", "16") as router:
        prompt = fresh_prompt()
        first = router.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert first.status_code == 200, first.text
        assert first.headers["x-kvevents-prefill"] != "skipped"

        def fresh(path: str, body: dict[str, Any]) -> httpx.Response:
            # a new connection each time: the kernel picks the process (SO_REUSEPORT)
            return httpx.post(router.url + path, json=body, timeout=30)

        def indexed_everywhere() -> bool:
            body = {"input_ids": [*prompt, 0]}
            return all(
                any(m["worker"] == decode.url and m["matched_tokens"] == len(prompt)
                    for m in fresh("/query", body).json()["matches"])
                for _ in range(8)
            )  # fmt: skip

        wait_until(indexed_everywhere, 10, "every router process to index the decode's copy")
        for _ in range(4):
            again = fresh("/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert again.status_code == 200, again.text
            assert again.headers["x-kvevents-prefill"] == "skipped"
        summed = [
            'kvevents_router_pd_requests_total{pool="decode"} 5.0',
            "kvevents_router_pd_prefill_skipped_total 4.0",
        ]
        wait_until(
            lambda: all(line in httpx.get(router.url + "/metrics").text for line in summed),
            10,
            "the group's /metrics to sum every process's P/D counters",
        )


def test_both_pools_over_https_with_keys(tmp_path: Path) -> None:
    """HTTPS engines requiring a key, in both roles, behind a router verifying them with
    --ssl-ca-certs and sending --engine-api-key on both legs; the client needs its own key."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(files["ca"])
    cert.private_key_pem.write_to_path(files["key"])
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(files["cert"], append=i > 0)
    tls = ["--ssl-certfile", files["cert"], "--ssl-keyfile", files["key"]]
    keyed = ["--api-key", "engine-key", *tls]
    prefill = Engine(
        ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0", *keyed],
        KV_CONFIG,
    )
    try:
        decode = Engine(["--disaggregation-mode", "decode", *keyed], KV_CONFIG)
        try:
            assert prefill.url.startswith("https://") and decode.url.startswith("https://")
            router = RouterProc(
                [],
                "--prefill", prefill.url, "--decode", decode.url,
                "--ssl-ca-certs", files["ca"], "--engine-api-key", "engine-key",
                "--api-key", "client-key", "--max-local-prefill-tokens", "0",
            )  # fmt: skip
            try:
                auth = {"authorization": "Bearer client-key"}
                body = {"prompt": fresh_prompt(), "max_tokens": 2}
                assert router.http.post("/v1/completions", json=body).status_code == 401

                def served() -> bool:
                    answer = router.http.post("/v1/completions", json=body, headers=auth)
                    return (
                        answer.status_code == 200
                        and answer.headers["x-kvevents-prefill"] != "skipped"
                    )

                wait_until(served, 20, "a request through both HTTPS engines")
            finally:
                router.stop()
        finally:
            decode.stop()
    finally:
        prefill.stop()
