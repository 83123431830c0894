"""The engine client's JSON reads (``Upstream.get_json``, ``FullResponse.json``) against
scripted HTTP servers on real loopback sockets: what registration, discovery, the models
and the P/D bootstrap ports are read with."""

from __future__ import annotations

import asyncio

import pytest
from upstream_support import Server, answer_once, keep_alive, run, serving

from kvevents.http.upstream import Upstream
from kvevents.http.upstream_answers import FullResponse
from kvevents.http.upstream_errors import UpstreamError


def _answer(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        content_type,
        len(body),
        body,
    )


INFO = b'{"kv_events": {"dp_size": 2}, "served_model_names": ["tiny"]}'


def test_a_json_answer_is_parsed_and_sent_with_the_clients_key_on_one_connection() -> None:
    """Two reads of a 200 JSON answer give its status and parsed body, as GETs without a
    body that carry the client's fixed headers, on one kept-alive connection."""

    async def main() -> None:
        async with serving(keep_alive(_answer("200 OK", INFO))) as server:
            client = Upstream(timeout=5, headers={"authorization": "Bearer engine-key"})
            for _ in range(2):
                status, info = await client.get_json(server.url, "/server_info", timeout=5)
                assert status == 200
                assert info == {"kv_events": {"dp_size": 2}, "served_model_names": ["tiny"]}
            await client.close()
        assert server.connections == 1
        head, body = server.requests[1]
        lines = head.split(b"\r\n")
        assert lines[0] == b"GET /server_info HTTP/1.1" and body == b""
        assert b"authorization: Bearer engine-key" in lines

    run(main())


def test_an_answer_other_than_200_gives_its_status_and_no_document() -> None:
    """A 404 (or a 401) is the engine's error page, not the document: its status and None,
    whatever JSON its body holds."""

    async def main() -> None:
        for status_line, code in (("404 Not Found", 404), ("401 Unauthorized", 401)):
            answer = _answer(status_line, b'{"detail": "Not Found"}')
            async with serving(keep_alive(answer)) as server:
                client = Upstream(timeout=5)
                assert await client.get_json(server.url, "/v1/models", timeout=5) == (code, None)
                await client.close()

    run(main())


def test_a_200_whose_body_is_not_json_is_a_value_error_naming_the_url() -> None:
    """An HTML page answered with 200 is a ValueError that names the URL read and says
    the body is not JSON."""

    async def main() -> None:
        page = _answer("200 OK", b"<html>hello</html>", b"text/html")
        async with serving(keep_alive(page)) as server:
            client = Upstream(timeout=5)
            with pytest.raises(ValueError, match="not JSON") as caught:
                await client.get_json(server.url, "/server_info", timeout=5)
            assert f"GET {server.url}/server_info" in str(caught.value)
            await client.close()

    run(main())


def test_no_answer_within_the_timeout_is_a_timeout_error() -> None:
    """A server that reads the request and never answers ends the read at its own
    timeout with TimeoutError (a slow engine), not an UpstreamError."""

    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await server.request(r)
            await r.read()  # holds the connection until the client closes it

        server = Server(silent)
        async with server:
            client = Upstream(timeout=60)
            with pytest.raises(TimeoutError):
                await client.get_json(server.url, "/server_info", timeout=0.2)
            await client.close()
        assert len(server.requests) == 1

    run(main())


def test_an_engine_that_is_not_listening_is_an_upstream_error() -> None:
    """A refused connection is an UpstreamError naming the address (an engine down)."""

    async def main() -> None:
        async with serving(answer_once(b"")) as server:
            url = server.url
        client = Upstream(timeout=5)
        with pytest.raises(UpstreamError, match=url.removeprefix("http://")):
            await client.get_json(url, "/server_info", timeout=5)
        await client.close()

    run(main())


@pytest.mark.parametrize(
    ("body", "parsed"),
    [
        (b'{"a": [1, 2.5, null, true]}', {"a": [1, 2.5, None, True]}),
        ('{"name": "caf\u00e9"}'.encode("utf-16"), {"name": "caf\u00e9"}),
        (b"[]", []),
    ],
)
def test_a_whole_answers_body_parses_as_json(body: bytes, parsed: object) -> None:
    """FullResponse.json reads the body as JSON in any encoding JSON allows."""
    assert FullResponse(200, {}, body).json() == parsed


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe\xfd", b"not json"])
def test_a_body_that_is_not_json_is_a_value_error(body: bytes) -> None:
    """An empty, cut-short or undecodable body is a ValueError, never another exception."""
    with pytest.raises(ValueError):
        FullResponse(200, {}, body).json()
