"""``--tokenize-endpoint``: the engine's ``/tokenize`` asked over real sockets.

The tokenizer posts through the router's engine client (:class:`Upstream`), so its
requests ride the kept-alive connections and carry the engines' key; on its own it
opens a client per request. Every answer an engine can give is scripted on the wire.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from upstream_support import Server, answer_once, keep_alive, run, serving

from kvevents.http.upstream import Upstream
from kvevents.router.prompts.tokenize import EndpointTokenizer, TokenizeError


def answer(status: int, body: bytes) -> bytes:
    reason = b"OK" if status == 200 else b"Refused"
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        reason,
        len(body),
        body,
    )


TOKENS = answer(200, b'{"tokens": [5, 6, 7], "count": 3, "max_model_len": 4096}')


def test_prompts_and_chats_share_one_kept_alive_connection_with_the_engines_key() -> None:
    async def main() -> None:
        async with serving(keep_alive(TOKENS)) as server:
            upstream = Upstream(timeout=5, headers={"authorization": "Bearer engine-key"})
            tokenizer = EndpointTokenizer(f"{server.url}/tokenize", upstream)
            assert await tokenizer.encode("hello", model="m") == [5, 6, 7]
            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": True,
                "temperature": 0.5,  # not a rendering field: not sent
            }
            assert await tokenizer.encode_chat(chat) == [5, 6, 7]
            await upstream.close()
        assert server.connections == 1
        (head1, body1), (_, body2) = server.requests
        assert head1.startswith(b"POST /tokenize HTTP/1.1\r\n")
        assert b"\r\nauthorization: Bearer engine-key\r\n" in head1
        assert json.loads(body1) == {"prompt": "hello", "add_special_tokens": True, "model": "m"}
        assert json.loads(body2) == {
            "messages": [{"role": "user", "content": "hi"}],
            "model": "m",
            "add_generation_prompt": True,
        }

    run(main())


def test_on_its_own_it_opens_a_client_per_request_and_closes_it() -> None:
    async def main() -> None:
        async with serving(answer_once(TOKENS, then_hold=True)) as server:
            tokenizer = EndpointTokenizer(f"{server.url}/tokenize?v=1")
            assert await tokenizer.encode("x", add_special_tokens=False) == [5, 6, 7]
            assert await tokenizer.encode("y") == [5, 6, 7]
            # each request's own client closed its connection: the server saw two
        assert server.connections == 2
        assert server.requests[0][0].startswith(b"POST /tokenize?v=1 HTTP/1.1\r\n")
        assert json.loads(server.requests[0][1]) == {"prompt": "x", "add_special_tokens": False}

    run(main())


@pytest.mark.parametrize(
    ("sent", "status", "words"),
    [
        (answer(422, b'{"detail": "prompt too long"}'), 422, "answered HTTP 422: "),
        (answer(400, b'{"error": "bad"}'), 400, "answered HTTP 400"),
        (answer(404, b"Not Found"), 502, "answered HTTP 404: Not Found"),
        (answer(500, b"boom"), 502, "answered HTTP 500: boom"),
        (answer(200, b'{"tokens": [1, true]}'), 502, "did not answer"),
        (answer(200, b'{"ids": [1]}'), 502, "did not answer"),
        (answer(200, b"not json"), 502, "did not answer"),
        (b"garbage\r\n\r\n", 502, "tokenizing at"),
    ],
)
def test_each_failure_is_a_tokenize_error_with_the_status_to_answer(
    sent: bytes, status: int, words: str
) -> None:
    """The engine's 400/413/422 blame the input (the client's to fix); anything else,
    a wrong path included, is the router's or the engine's fault: 502."""

    async def main() -> None:
        async with serving(keep_alive(sent)) as server:
            upstream = Upstream(timeout=5)
            tokenizer = EndpointTokenizer(f"{server.url}/tokenize", upstream)
            with pytest.raises(TokenizeError) as failed:
                await tokenizer.encode("x")
            await upstream.close()
        assert failed.value.status == status
        assert words in str(failed.value)
        assert f"{server.url}/tokenize" in str(failed.value)

    run(main())


def test_an_engine_that_is_down_or_silent_is_named() -> None:
    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read()
            w.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        upstream = Upstream(timeout=600)  # the router's forward timeout: not the tokenizer's
        silent_url = f"http://127.0.0.1:{port}/tokenize"
        with pytest.raises(TokenizeError, match=rf"127\.0\.0\.1:{port}/tokenize failed: Timeout"):
            await EndpointTokenizer(silent_url, upstream, timeout=0.3).encode("x")
        server.close()
        await server.wait_closed()
        down = EndpointTokenizer(f"http://127.0.0.1:{port}/tokenize", upstream)
        with pytest.raises(TokenizeError, match=r"cannot connect to 127\.0\.0\.1") as failed:
            await down.encode("x")
        assert failed.value.status == 502
        await upstream.close()

    run(main())


def test_a_url_that_is_not_http_is_refused_with_an_example() -> None:
    with pytest.raises(Exception, match=r"give the full URL, e\.g\. http://"):
        EndpointTokenizer("127.0.0.1:8000/tokenize")


def test_credentials_in_the_url_are_refused_without_echoing_them() -> None:
    with pytest.raises(Exception, match="--engine-api-key") as refused:
        EndpointTokenizer("http://user:secret@127.0.0.1:8000/tokenize")
    assert "secret" not in str(refused.value)


def test_a_request_the_engine_dropped_before_answering_is_sent_once_more() -> None:
    """The engine closed the kept-alive connection as the request left: tokenizing
    changes nothing, so the request goes again on a new connection; the path is sent
    %-escaped as an HTTP client sends it."""

    async def main() -> None:
        async def drop_then_answer(
            r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int
        ) -> None:
            await server.request(r)
            if n == 1:
                w.write(TOKENS)  # the first request on connection 1 is answered
                await w.drain()
                await server.request(r)  # the second is read, then the connection dropped
                return
            w.write(TOKENS)
            await w.drain()
            await r.read()

        server = Server(drop_then_answer)
        async with server:
            upstream = Upstream(timeout=5)
            tokenizer = EndpointTokenizer(f"{server.url}/v1/tök en?x=a b", upstream)
            assert await tokenizer.encode("one") == [5, 6, 7]
            assert await tokenizer.encode("two") == [5, 6, 7]
            await upstream.close()
        assert server.connections == 2
        assert [head.split(b"\r\n")[0] for head, _ in server.requests] == [
            b"POST /v1/t%C3%B6k%20en?x=a%20b HTTP/1.1"
        ] * 3
        assert [json.loads(body)["prompt"] for _, body in server.requests] == ["one", "two", "two"]

    run(main())
