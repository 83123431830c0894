"""Models and adapters end to end: two simulated engines serving different models behind one router.

Engine A serves ``alpha`` with the LoRA adapter ``sql`` and vLLM's hashes (its adapter
stores carry vLLM's ``lora_name``, ``lora_id`` and ``extra_keys``); engine B serves
``beta`` with SGLang's hashes. Both are discovered through ``/server_info``, and their models
read from it. Every process and socket is real.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

pytestmark = pytest.mark.slow  # two engines and a router as subprocesses

PAGE = 4


@pytest.fixture(scope="module")
def plane() -> Iterator[tuple[Engine, Engine, RouterProc]]:
    common = ["--page-size", str(PAGE), "--max-blocks", "256"]
    adapter = ["--lora-modules", "sql=/adapters/sql", "--hash-scheme", "vllm"]
    a = Engine([*common, "--served-model-name", "alpha", *adapter], KV_CONFIG)
    b = Engine([*common, "--served-model-name", "beta"], KV_CONFIG)
    router = None
    try:
        router = RouterProc([a.url, b.url], "--load-interval", "0.2")
        wait_until(lambda: router.connected() == 2, 20, "the router to follow both engines")
        wait_until(
            lambda: len(router.http.get("/v1/models").json()["data"]) == 3,
            20,
            "the router to read both engines' models",
        )
        yield a, b, router
    finally:
        for proc in (router, a, b):
            if proc is not None:
                proc.stop()


def finished(engine: Engine) -> int:
    ranks = engine.http.get("/load").json()["ranks"]
    return sum(r["requests_finished"] for r in ranks)


def matched(router: RouterProc, tokens: list[int], model: str) -> dict[str, int]:
    answer = router.post("/query", {"input_ids": tokens, "model": model})
    assert answer.status_code == 200, answer.text
    return {m["worker"]: m["matched_tokens"] for m in answer.json()["matches"]}


def test_v1_models_is_the_union_of_the_engines_models(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """The router's /v1/models lists each engine's models once, adapters with their parent."""
    _, _, router = plane
    body = router.http.get("/v1/models").json()
    assert body["object"] == "list"
    cards = {c["id"]: c for c in body["data"]}
    assert sorted(cards) == ["alpha", "beta", "sql"]
    assert cards["sql"]["parent"] == "alpha" and cards["sql"]["root"] == "/adapters/sql"
    assert cards["alpha"]["parent"] is None and cards["alpha"]["object"] == "model"
    engines = {e["url"]: e for e in router.http.get("/workers").json()["engines"]}
    assert {tuple(e["models"]) for e in engines.values()} == {("alpha", "sql"), ("beta",)}
    assert {e["models_source"] for e in engines.values()} == {"/server_info"}


def test_two_models_never_receive_each_others_requests(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """Requests for alpha (and its adapter) all reach engine A, those for beta engine B,
    whatever either engine has cached."""
    a, b, router = plane
    before = finished(a), finished(b)
    shared = list(range(1000, 1016))  # the same prompt for both models
    for i in range(4):
        for model, engine in (("alpha", a), ("beta", b), ("sql", a)):
            body = {"model": model, "prompt": [*shared, i], "max_tokens": 1}
            answer = router.post("/v1/completions", body)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvevents-worker"] == engine.url
            assert answer.json()["model"] == model
    assert (finished(a) - before[0], finished(b) - before[1]) == (8, 4)
    routed = router.post("/route", {"input_ids": shared, "model": "beta"}).json()
    assert routed["worker"] == b.url and routed["holders"] == 1


def test_an_unknown_model_answers_404_listing_the_models(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """A model no engine serves answers 404 in OpenAI's shape on the OpenAI routes, and 404
    on /query and /route, each naming the models served."""
    _, _, router = plane
    answer = router.post("/v1/completions", {"model": "gpt-9", "prompt": [1, 2, 3, 4]})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model" and error["code"] == 404
    assert "`gpt-9` does not exist" in error["message"]
    assert "alpha, beta, sql" in error["message"]
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert router.post("/v1/chat/completions", chat).status_code == 404
    for path in ("/query", "/route"):
        answer = router.post(path, {"input_ids": [1, 2, 3, 4], "model": "gpt-9"})
        assert answer.status_code == 404 and "alpha, beta, sql" in answer.json()["error"]


def test_adapter_and_base_prompts_do_not_match_each_other(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """Blocks the adapter's requests stored match /query for the adapter only, and the base
    model's blocks match the base model only; the engine's cached_tokens agree."""
    a, _, router = plane
    adapter_prompt, base_prompt = list(range(2000, 2012)), list(range(3000, 3012))
    for model, prompt in (("sql", adapter_prompt), ("alpha", base_prompt)):
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        assert router.post("/v1/completions", body).status_code == 200
    wait_until(
        lambda: matched(router, [*adapter_prompt, 0], "sql")[a.url] == 12,
        10,
        "the adapter's blocks in the index",
    )
    wait_until(
        lambda: matched(router, [*base_prompt, 0], "alpha")[a.url] == 12,
        10,
        "the base model's blocks in the index",
    )
    assert matched(router, [*adapter_prompt, 0], "alpha") == {a.url: 0}
    assert matched(router, [*base_prompt, 0], "sql") == {a.url: 0}
    again = router.post("/v1/completions", {"model": "alpha", "prompt": adapter_prompt})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again.headers["x-kvevents-matched-tokens"] == "0"
    cached = router.post("/v1/completions", {"model": "sql", "prompt": adapter_prompt})
    assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert cached.headers["x-kvevents-matched-tokens"] == "8"


def test_a_list_of_prompts_is_routed_whole_and_answered_per_prompt(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """A batch goes to one engine of its model; the answer has choice i for prompt i, usage
    summed, and the decision headers count every prompt."""
    _, b, router = plane
    prompts = [list(range(4000, 4008)), list(range(4100, 4104)), "abcd"]
    body = {"model": "beta", "prompt": prompts, "max_tokens": 2}
    answer = router.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-kvevents-worker"] == b.url
    assert answer.headers["x-kvevents-prompt-tokens"] == "16"
    result = answer.json()
    assert result["object"] == "text_completion"
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert result["usage"]["prompt_tokens"] == 16 and result["usage"]["completion_tokens"] == 6


def test_generate_keys_its_request_as_the_engine_runs_it(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """``/generate`` keys a request by the adapter it runs under (``lora_path``, SGLang's
    name, or a ``model`` naming an adapter, which the router then passes on as
    ``lora_path``) and by its per-block ``extra_keys``, as ``/route`` does: the blocks the
    router counts as cached are the tokens the engine finds cached. (They were keyed as
    the base model's plain text: 6 blocks claimed, 0 found.)"""
    _, _, router = plane
    images: list[object] = [[["img", 0]], None, None, None, None, None]
    cases = ({"lora_path": "sql"}, {"lora": "sql"}, {"model": "sql"}, {"extra_keys": images})
    for n, extra in enumerate(cases):
        prompt = list(range(3000 + 100 * n, 3024 + 100 * n))  # 6 blocks
        base = {"input_ids": prompt, "model": "alpha", "max_new_tokens": 1}
        assert router.post("/generate", base).status_code == 200  # cached as plain text
        wait_until(lambda p=prompt: matched(router, p, "alpha") != {}, 10, "the base prompt")
        body = base | extra
        # /query takes the router's members only (max_new_tokens is the engine's)
        asked = {k: v for k, v in body.items() if k != "max_new_tokens"}
        for expected in (0, len(prompt) - PAGE):  # first nothing cached, then all it reuses
            answer = router.post("/generate", body)
            assert answer.status_code == 200, answer.text
            routed, engine_cached = answer.json()["router"], answer.json()["cached_tokens"]
            assert routed["cached_blocks"] * PAGE == engine_cached == expected, (extra, routed)
            wait_until(
                lambda asked=asked: (
                    max(m["matched_tokens"] for m in router.post("/query", asked).json()["matches"])
                    == PAGE * 5
                ),
                10,
                f"the request with {extra} indexed",
            )


def test_generate_refuses_two_different_adapter_names(
    plane: tuple[Engine, Engine, RouterProc],
) -> None:
    """``lora`` and ``lora_path`` naming different adapters is a 400 saying so."""
    _, _, router = plane
    body = {"input_ids": [1, 2, 3, 4], "lora": "sql", "lora_path": "other"}
    for path in ("/generate", "/route"):
        answer = router.post(path, body)
        assert answer.status_code == 400 and "name the adapter once" in answer.text
