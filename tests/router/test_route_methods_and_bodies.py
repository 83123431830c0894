"""POST-only routes answer 405 to other methods, and a ``/route`` or ``/query`` body with a
member the router does not take is a 400 naming it, on every decoding path: msgspec
alone, the compiled kernels' (ids first), and uvicorn's inline path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import pytest
from router_support import Engine, RouterProc, wait_until

from kvevents import kernels
from kvevents.router.prompts.token_body import BadRequest, GenerateBody, decode_tokens_body

IDS = b"[" + b", ".join(b"%d" % i for i in range(1, 21)) + b"]"  # a block and a tail
UNKNOWN = [
    b'{"input_ids": ' + IDS + b', "topp": 2}',  # ids first: the compiled path's body
    b'{"topp": 2, "input_ids": ' + IDS + b"}",
    b'{"text": "hello, world, and more", "bogus": null}',
    b'{"input_ids": ' + IDS + b', "record": true, "sampling_params": {"max_new_tokens": 1}}',
]
"""Bodies with one unknown member each (the one :func:`_name` finds)."""


def _name(raw: bytes) -> str:
    members: dict[str, object] = msgspec.json.decode(raw)
    return next(k for k in members if k not in ("input_ids", "text", "record"))


def _refusal(raw: bytes) -> str:
    with pytest.raises(BadRequest) as caught:
        decode_tokens_body(raw)
    return str(caught.value)


@pytest.mark.parametrize("compiled", [True, False], ids=["kernels", "plain"])
@pytest.mark.parametrize("raw", UNKNOWN)
def test_an_unknown_member_is_refused_by_name_with_and_without_kernels(
    raw: bytes, compiled: bool
) -> None:
    """Decoding refuses the body naming its unknown member, with the same words whether
    the compiled kernels are loaded or not; an engine /generate body (strict=False) keeps
    it and decodes."""
    if compiled:
        assert kernels.load() is not None, kernels.status()
        message = _refusal(raw)
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "_kernels", None)
            assert kernels.loaded() is None
            message = _refusal(raw)
    name = _name(raw)
    assert message.startswith(f"request body: unknown member '{name}'"), message
    assert "accepted members: input_ids, text, messages" in message
    tokens, body = decode_tokens_body(raw, chat=False, strict=False)
    assert isinstance(body, GenerateBody)
    assert tokens is not None or body.text == "hello, world, and more"


def test_a_near_miss_is_suggested_and_chat_template_fields_are_members() -> None:
    """A misspelt member gets a suggestion; a chat's template fields, which the tokenizer
    reads, are accepted in a /route body."""
    assert "(did you mean 'top'?)" in _refusal(b'{"input_ids": [1], "topp": 2}')
    chat = (
        b'{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false,'
        b' "chat_template_kwargs": {"enable_thinking": false}, "tools": []}'
    )
    tokens, body = decode_tokens_body(chat)
    assert tokens is None and body.add_generation_prompt is False
    assert isinstance(decode_tokens_body(b'{"text": "a", "x": 1}', strict=False)[1], GenerateBody)


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(["--dp-size", "2"], None)


ROUTERS = {
    "uvicorn": ((), {}),
    "uvicorn-no-kernels": ((), {"KVEVENTS_KERNELS": "0"}),
}


@pytest.fixture(scope="module", params=sorted(ROUTERS))
def router(
    make_router: Callable[..., RouterProc], engine: Engine, request: pytest.FixtureRequest
) -> Iterator[RouterProc]:
    args, env = ROUTERS[request.param]
    proc = make_router([engine.url], *args, env=env)
    wait_until(lambda: proc.http.get("/ready").status_code == 200, 20, "the router ready")
    if not env:  # the compiled path is the one to check: wait for it
        wait_until(
            lambda: proc.http.get("/workers").json()["process"]["kernels"] != "loading",
            60,
            "the kernels loaded",
        )
    yield proc
    proc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/route", "/query", "/v1/completions", "/v1/chat/completions"])
def test_another_method_on_a_post_route_is_405_with_allow_post(
    router: RouterProc, method: str, path: str
) -> None:
    """GET, PUT or DELETE on a POST-only route answers 405 with ``Allow: POST`` and an
    error saying so, in the route's error shape (OpenAI's for the OpenAI routes)."""
    answer = router.http.request(method, path)
    assert answer.status_code == 405, answer.text
    assert answer.headers["allow"] == "POST"
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert message.startswith(f"{method} {path}: method not allowed"), message


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/route", "/query"])
@pytest.mark.parametrize("raw", UNKNOWN)
def test_an_unknown_member_of_a_route_or_query_body_is_a_400_naming_it(
    router: RouterProc, path: str, raw: bytes
) -> None:
    """The router answers 400 naming the unknown member, on every server and with or
    without the kernels; the same body without it is answered 200."""
    answer = router.http.post(path, content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"].startswith(f"request body: unknown member '{_name(raw)}'")
    members = msgspec.json.decode(raw)
    del members[_name(raw)]
    assert router.post(path, members).status_code == 200


@pytest.mark.slow
def test_an_engine_generate_body_keeps_its_own_members(router: RouterProc) -> None:
    """/generate takes the engine's members (``max_new_tokens``, ``sampling_params``)
    beside the router's: it is routed and forwarded, not refused."""
    body = {"input_ids": list(range(1, 21)), "max_new_tokens": 2, "sampling_params": {"top_k": 1}}
    answer = router.post("/generate", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["completion_tokens"] == 2
