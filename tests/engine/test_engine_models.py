"""The simulated engine's models: served names, LoRA adapters in their own cache namespace, batches."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import cbor2
import pytest
from engine_support import Engine, stream_events

from kvevents import BlockStored
from kvevents.engine.cache import PrefixCache
from kvevents.engine.models import (
    DEFAULT_MODEL_NAME,
    LoraModule,
    ServedModels,
    UnknownModel,
    parse_lora_modules,
    parse_served_model_names,
)
from kvevents.errors import ConfigError
from kvevents.wire.hashing import VLLMSha256CborHash, get_hash_scheme

PAGE = 4


def test_served_names_take_repeats_and_comma_lists_and_default_to_the_sim_name() -> None:
    """--served-model-name is repeatable or a comma list, as vLLM's; none gives the default."""
    assert parse_served_model_names(["a,b", "c", "a"]) == ("a", "b", "c")
    assert parse_served_model_names(None) == (DEFAULT_MODEL_NAME,)
    with pytest.raises(ConfigError, match="empty name"):
        parse_served_model_names(["a,,b"])


def test_lora_modules_are_name_path_pairs_numbered_from_one() -> None:
    """--lora-modules name=path gets ids 1, 2, ... in order; a bad pair or a repeat is refused."""
    assert parse_lora_modules(["sql=/x", "chat=/y"]) == (
        LoraModule("sql", "/x", 1),
        LoraModule("chat", "/y", 2),
    )
    with pytest.raises(ConfigError, match="not name=path"):
        parse_lora_modules(["sql"])
    with pytest.raises(ConfigError, match="twice"):
        parse_lora_modules(["sql=/x", "sql=/y"])
    with pytest.raises(ConfigError, match="share a name"):
        ServedModels(names=("sql",), loras=parse_lora_modules(["sql=/x"]))


def test_an_engine_without_model_flags_takes_any_model() -> None:
    """Without --served-model-name or --lora-modules any model is the base model, as before
    models existed, and /server_info says so with null names."""
    models = ServedModels()
    assert models.resolve("whatever") is None
    assert models.server_info()["served_model_names"] is None


def test_resolve_maps_names_to_the_base_model_or_an_adapter() -> None:
    """No model or a served name is the base model; an adapter's name is it; others are unknown."""
    models = ServedModels(names=("a", "b"), loras=parse_lora_modules(["sql=/x"]), configured=True)
    assert models.resolve(None) is None and models.resolve("b") is None
    assert models.resolve("sql") == LoraModule("sql", "/x", 1)
    with pytest.raises(UnknownModel, match="`nope` does not exist: this engine serves a, b, sql"):
        models.resolve("nope")


def test_an_empty_salt_names_pages_as_no_salt_as_vllm_does() -> None:
    """vLLM adds a salt to the first block's keys only when it is non-empty."""
    cache = PrefixCache(PAGE, 64, get_hash_scheme("vllm"))
    tokens = list(range(8))
    assert cache.admit(tokens, cache_salt="").cached_tokens == 0
    assert cache.match(tokens) == 4
    (store,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert store.extra_keys is None


def test_an_adapter_and_a_salt_together_name_pages_as_vllm_does() -> None:
    """Under an adapter and a salt, pages match neither the adapter alone nor the salt alone,
    and the store's extra_keys are vLLM's: the adapter's name on every block, the salt
    after it on the first."""
    cache = PrefixCache(PAGE, 64, get_hash_scheme("vllm"))
    tokens = list(range(8))
    assert cache.admit(tokens, lora_name="sql", lora_id=1, cache_salt="s").cached_tokens == 0
    assert cache.match(tokens, lora_name="sql") == 0
    assert cache.match(tokens, cache_salt="s") == 0
    assert cache.match(tokens, lora_name="sql", cache_salt="s") == 4
    (store,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert (store.lora_name, store.lora_id) == ("sql", 1)
    assert store.extra_keys == [["sql", "s"], ["sql"]]
    # and the hashes are vLLM's: each block's extra keys inside its cbor tuple (they were
    # hashed apart, after it)
    scheme = get_hash_scheme("vllm")
    assert isinstance(scheme, VLLMSha256CborHash)

    def block(parent: bytes, tokens: list[int], keys: tuple[str, ...]) -> bytes:
        return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), keys), canonical=True)).digest()

    first = block(scheme.none_hash, tokens[:4], ("sql", "s"))
    second = block(first, tokens[4:], ("sql",))
    assert store.block_hashes == [scheme.event_hash(first), scheme.event_hash(second)]


@pytest.mark.parametrize("scheme", ["sglang", "vllm"])
def test_adapter_pages_live_in_their_own_namespace(scheme: str) -> None:
    """The same tokens under an adapter, another adapter and the base model share no page, and
    the adapter's BlockStored carries lora_name and lora_id (and vLLM's extra_keys per block)."""
    cache = PrefixCache(PAGE, 64, get_hash_scheme(scheme))
    tokens = list(range(8))
    assert cache.admit(tokens).cached_tokens == 0
    assert cache.admit(tokens, lora_name="sql", lora_id=1).cached_tokens == 0
    assert cache.admit(tokens, lora_name="chat", lora_id=2).cached_tokens == 0
    assert cache.admit(tokens, lora_name="sql", lora_id=1).cached_tokens == 4
    assert cache.match(tokens) == 4 and cache.match(tokens, lora_name="sql") == 4
    assert cache.match(tokens, lora_name="other") == 0
    stores = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert len(stores) == 3
    base, sql, chat = stores
    assert (base.lora_name, base.lora_id, base.extra_keys) == (None, None, None)
    assert (sql.lora_name, sql.lora_id) == ("sql", 1)
    assert (chat.lora_name, chat.lora_id) == ("chat", 2)
    assert sql.extra_keys == ([["sql"], ["sql"]] if scheme == "vllm" else None)
    assert not set(base.block_hashes) & set(sql.block_hashes)
    assert not set(sql.block_hashes) & set(chat.block_hashes)
    assert len(cache) == 6


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    config = {"publisher": "zmq", "endpoint": "tcp://*:0"}
    args = ["--page-size", str(PAGE), "--served-model-name", "tiny,tiny-8b"]
    args += ["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"]
    return make_engine(args, config)


def test_v1_models_lists_served_names_and_adapters_as_vllm_does(engine: Engine) -> None:
    """GET /v1/models lists every served name (root the base, no parent) and every adapter
    (root its path, parent the base model); /server_info names them too."""
    body = engine.http.get("/v1/models").json()
    assert body["object"] == "list"
    cards = {c["id"]: c for c in body["data"]}
    assert list(cards) == ["tiny", "tiny-8b", "sql", "chat"]
    assert cards["tiny-8b"]["root"] == "tiny" and cards["tiny-8b"]["parent"] is None
    assert cards["sql"]["root"] == "/adapters/sql" and cards["sql"]["parent"] == "tiny"
    assert all(c["object"] == "model" and c["owned_by"] == "kvevents" for c in cards.values())
    info = engine.server_info()
    assert info["served_model_name"] == "tiny"
    assert info["served_model_names"] == ["tiny", "tiny-8b"]
    assert info["lora_modules"] == [
        {"name": "sql", "path": "/adapters/sql", "id": 1},
        {"name": "chat", "path": "/adapters/chat", "id": 2},
    ]


def test_an_unknown_model_answers_404_in_openai_shape(engine: Engine) -> None:
    """A completion or chat for a model the engine does not serve answers 404 NotFoundError,
    naming the param and listing what is served."""
    for path, body in (
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
        (
            "/v1/chat/completions",
            {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        ),
    ):
        answer = engine.http.post(path, json=body)
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["type"] == "NotFoundError" and error["param"] == "model"
        assert error["code"] == 404
        assert (
            "`gpt-9` does not exist" in error["message"]
            and "tiny, tiny-8b, sql, chat" in error["message"]
        )


def _cached(engine: Engine, model: str | None, prompt: list[int]) -> int:
    body = {"prompt": prompt, "max_tokens": 1}
    if model is not None:
        body["model"] = model
    answer = engine.http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    cached: int = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_adapter_requests_keep_their_own_prefix_cache(engine: Engine) -> None:
    """A prompt cached for the base model (under any served name) is not reused by an adapter's
    request, nor the reverse; each adapter reuses its own."""
    prompt = list(range(100, 108))
    assert _cached(engine, "tiny", prompt) == 0
    assert _cached(engine, "tiny-8b", prompt) == 4  # another name of the same model
    assert _cached(engine, "sql", prompt) == 0
    assert _cached(engine, "sql", prompt) == 4
    assert _cached(engine, "chat", prompt) == 0
    other = list(range(200, 208))
    assert _cached(engine, "sql", other) == 0
    assert _cached(engine, None, other) == 0  # no model: the base model
    generated = engine.http.post(
        "/generate", json={"input_ids": other, "max_new_tokens": 1, "lora_path": "sql"}
    )
    assert generated.json()["cached_tokens"] == 4
    refused = engine.http.post("/generate", json={"input_ids": other, "lora_path": "nope"})
    assert refused.status_code == 400 and "sql, chat" in refused.json()["error"]
    # a served model's name is no adapter (it ran the base model, answering 200)
    named = engine.http.post("/generate", json={"input_ids": other, "lora_path": "tiny"})
    assert named.status_code == 400 and "no adapter of this engine" in named.json()["error"]


def test_a_batch_of_prompts_answers_one_choice_per_prompt(engine: Engine) -> None:
    """A list of prompts answers choice i for prompt i, on one rank, with usage summed."""
    prompts = [list(range(300, 308)), "abcdefgh", list(range(300, 306))]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 3}
    answer = engine.http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"] == "abc" for c in answer["choices"])
    usage = answer["usage"]
    assert usage["prompt_tokens"] == 8 + 8 + 6
    assert usage["completion_tokens"] == 9 and usage["total_tokens"] == 31
    # the first prompt runs first and picks the rank; the third reuses its first page
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4


def test_a_streamed_batch_numbers_each_prompts_chunks(engine: Engine) -> None:
    """Streaming a batch sends every prompt's tokens under its own choice index, then usage."""
    body = {"prompt": ["xy", "zw"], "max_tokens": 2, "stream": True}
    body["stream_options"] = {"include_usage": True}
    _, events = stream_events(engine.http, "/v1/completions", body)
    texts: dict[int, str] = {}
    for event in events[:-1]:  # the last is the usage chunk ([DONE] is not returned)
        [choice] = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "ab", 1: "ab"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 4
