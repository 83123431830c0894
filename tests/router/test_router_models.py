"""The router's models in-process: the catalog, candidates per model, adapters' namespaces, batches."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai_support import FakeEngine

from kvevents import BlockStored, Delivery, Holder, KVEventBatch, Router
from kvevents.router.decide.batch import combine_scores
from kvevents.router.decide.models import (
    EngineModels,
    ModelCatalog,
    UnknownModelError,
    models_from_names,
    models_from_server_info,
    models_from_v1_models,
)
from kvevents.router.serve.service import RouterService
from kvevents.subscribe.engine_spec import EngineSpec

A0, A1, B0, C0 = Holder("a", 0), Holder("a", 1), Holder("b", 0), Holder("c", 0)

VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "llama", "object": "model", "owned_by": "vllm", "root": "/m/llama", "parent": None},
        {"id": "sql", "object": "model", "owned_by": "vllm", "root": "/a/sql", "parent": "llama"},
    ],
}


def stored(
    hashes: list[int],
    tokens: list[int],
    *,
    lora_name: str | None = None,
    lora_id: int | None = None,
) -> KVEventBatch:
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=2,
        lora_id=lora_id,
        medium=None,
        lora_name=lora_name,
    )
    return KVEventBatch(ts=0.0, events=[event])


def make_router(*holders: Holder) -> Router:
    router = Router(block_size=2)
    for h in holders:
        router.add_holder(h, block_size=2)
    return router


def served(*names: str, adapters: dict[str, str] | None = None) -> EngineModels:
    data: list[dict[str, Any]] = [{"id": n} for n in names]
    data += [{"id": a, "parent": p} for a, p in (adapters or {}).items()]
    found = models_from_v1_models({"data": data})
    assert found is not None
    return found


def test_vllm_v1_models_lists_base_models_and_adapters_with_their_parent() -> None:
    """/v1/models entries become cards; an entry with a parent is an adapter of it."""
    models = models_from_v1_models(VLLM_MODELS)
    assert models is not None and models.source == "/v1/models"
    assert models.names() == ["llama", "sql"]
    assert [(c.root, c.parent, c.owned_by) for c in models.cards] == [
        ("/m/llama", None, "vllm"),
        ("/a/sql", "llama", "vllm"),
    ]
    assert models_from_v1_models({"data": []}) is None
    assert models_from_v1_models({"detail": "Not Found"}) is None


def test_server_info_names_sglang_and_simulated_engine_models() -> None:
    """SGLang's served_model_name (root model_path) and the simulated engine's lists both read."""
    sglang = models_from_server_info({"served_model_name": "qwen", "model_path": "/m/qwen"})
    assert sglang is not None and [(c.id, c.root) for c in sglang.cards] == [("qwen", "/m/qwen")]
    sim = models_from_server_info(
        {
            "served_model_name": "a",
            "served_model_names": ["a", "a2"],
            "lora_modules": [{"name": "sql", "path": "/x", "id": 1}],
        }
    )
    assert sim is not None and sim.names() == ["a", "a2", "sql"]
    assert sim.cards[-1].parent == "a"
    assert models_from_server_info({"dp_size": 1}) is None
    unconfigured = {"served_model_name": "kvevents-sim", "served_model_names": None}
    assert models_from_server_info(unconfigured) is None  # takes any model
    described = models_from_names(["x", "y", "x"])
    assert described is not None and described.names() == ["x", "y"]


def test_catalog_versions_changes_and_answers_the_union() -> None:
    """set() reports and counts changes only; v1_models lists every model once, sorted."""
    catalog = ModelCatalog()
    assert not catalog.known
    assert catalog.set("a", served("m1", adapters={"sql": "m1"}))
    assert not catalog.set("a", served("m1", adapters={"sql": "m1"}))
    assert catalog.set("b", served("m1", "m2"))
    assert catalog.version == 2
    body = catalog.v1_models()
    assert [(m["id"], m["parent"]) for m in body["data"]] == [
        ("m1", None),
        ("m2", None),
        ("sql", "m1"),
    ]
    assert catalog.set("b", None) and catalog.names() == ["m1", "sql"]


def test_without_model_information_every_holder_is_a_candidate() -> None:
    """No catalog, or no model in the request: every holder, as before models existed."""
    router = make_router(A0, B0)
    assert router.candidates("anything") == ([A0, B0], None)
    router.models.set("a", served("alpha"))
    assert router.candidates(None) == ([A0, B0], None)


def test_a_model_limits_candidates_to_its_engines_and_those_without_information() -> None:
    """Holders of engines serving the model, plus engines whose models are unknown, are candidates."""
    router = make_router(A0, A1, B0, C0)
    router.models.set("a", served("alpha"))
    router.models.set("b", served("beta"))
    assert router.candidates("alpha") == ([A0, A1, C0], None)
    assert router.candidates("beta") == ([B0, C0], None)
    router.models.set("c", served("gamma"))  # the catalog changed: cached candidates are redone
    assert router.candidates("alpha") == ([A0, A1], None)
    router.add_holder(Holder("a", 2))  # a new holder too
    assert router.candidates("alpha")[0] == [A0, A1, Holder("a", 2)]


def test_an_unknown_model_raises_with_the_models_served() -> None:
    """A model no engine serves, when every engine's models are known, is UnknownModelError."""
    router = make_router(A0, B0)
    router.models.set("a", served("alpha"))
    router.models.set("b", served("beta", adapters={"sql": "beta"}))
    with pytest.raises(UnknownModelError, match=r"`gpt` does not exist: .* serve alpha, beta, sql"):
        router.route([1, 2], model="gpt")
    with pytest.raises(UnknownModelError):
        router.query([1, 2], model="gpt")


def test_requests_for_a_model_go_only_to_its_engines_by_the_usual_cost() -> None:
    """Among the model's holders the cached one wins; another model's cached holder is never chosen."""
    router = make_router(A0, A1, B0)
    router.models.set("a", served("alpha"))
    router.models.set("b", served("beta"))
    router.handle(Delivery(B0, 0, stored([1, 2], [5, 6, 7, 8])))
    router.handle(Delivery(A1, 0, stored([3], [5, 6])))
    decision = router.route([5, 6, 7, 8, 9], model="alpha")
    assert decision.holder == A1 and [s.holder for s in decision.scores] == [A1, A0]
    assert router.route([5, 6, 7, 8, 9], model="beta").holder == B0
    assert set(router.query([5, 6], model="alpha")) == {A0, A1}
    assert router.route([5, 6, 7, 8, 9]).holder == B0  # no model: every holder, as before


def test_adapter_blocks_match_only_requests_for_that_adapter() -> None:
    """An adapter's stores (keyed by lora_name, as vLLM and SGLang send it) match a request for
    the adapter and not the base model's, and base-model blocks do not match the adapter's."""
    router = make_router(A0, A1)
    router.models.set("a", served("llama", adapters={"sql": "llama"}))
    assert router.candidates("sql") == ([A0, A1], "sql")
    router.handle(Delivery(A0, 0, stored([1, 2], [5, 6, 7, 8], lora_name="sql", lora_id=7)))
    router.handle(Delivery(A1, 0, stored([3, 4], [5, 6, 7, 8])))
    assert router.query([5, 6, 7, 8, 9], model="sql") == {A0: (2, 0, 0), A1: (0, 0, 0)}
    assert router.query([5, 6, 7, 8, 9], model="llama") == {A0: (0, 0, 0), A1: (2, 0, 0)}
    assert router.route([5, 6, 7, 8, 9], model="sql").holder == A0
    assert router.route([5, 6, 7, 8, 9], model="llama").holder == A1
    # an explicit lora wins over the model's
    assert router.query([5, 6, 7, 8, 9], model="llama", lora="sql")[A0].gpu == 2


def test_a_batch_goes_to_the_holder_with_the_lowest_summed_cost() -> None:
    """Each prompt is scored as a request of its own; the holder whose costs sum lowest wins,
    and the decision covers every prompt's blocks."""
    router = make_router(A0, A1)
    router.handle(Delivery(A0, 0, stored([1], [1, 2])))  # prompt 1's first block
    router.handle(Delivery(A1, 0, stored([2, 3, 4], [7, 8, 9, 10, 11, 12])))  # all of prompt 2
    prompts = [[1, 2, 3, 4], [7, 8, 9, 10, 11, 12]]
    alone = router.route(prompts[0])
    assert alone.holder == A0
    decision = router.route_batch(prompts)
    assert decision.holder == A1 and decision.n_blocks == 5
    assert len(decision.keys) == 5
    chosen = decision.chosen
    assert chosen.matched == (2, 0, 0) and chosen.prefill_blocks == 3.0
    assert decision.scores[1].prefill_blocks == 4.0
    assert router.route_batch(prompts[:1]) == router.route(prompts[0])


def test_combine_scores_sums_per_prompt_figures_and_keeps_holder_figures() -> None:
    """Summed: matched, cached, prefill, cost, predicted; kept: pending, recent, routed."""
    router = make_router(A0, A1)
    router.handle(Delivery(A0, 0, stored([1], [1, 2])))
    one = router.route([1, 2, 3, 4]).scores
    two = router.route([1, 2]).scores
    combined = combine_scores([one, two], [A0, A1])
    assert [s.holder for s in combined] == [A0, A1]
    assert combined[0].matched == (1, 0, 0) and combined[0].prefill_blocks == 2.0
    assert combined[1].cost == pytest.approx(one[1].cost + two[1].cost)
    assert combined[1].pending_blocks == one[1].pending_blocks


def test_models_are_read_from_v1_models_and_refreshed_when_they_change() -> None:
    """The engine watcher reads /v1/models over HTTP, and again later: an engine now serving
    another model is routed for that one (the router's own /v1/models shows it)."""
    fake = FakeEngine()
    fake.models = VLLM_MODELS

    async def go() -> list[list[str]]:
        router = Router(block_size=2)
        spec = EngineSpec.create(
            fake.url, kv_endpoint="tcp://127.0.0.1:5999", dp_size=2, kind="vllm"
        )
        service = RouterService(router, [spec], load_interval=0.05, models_interval=0.1)
        seen = []
        await service.start()
        try:
            for want in (["llama", "sql"], ["qwen"]):
                for _ in range(200):  # 10 s at most
                    if router.models.names() == want:
                        break
                    await asyncio.sleep(0.05)
                seen.append(router.models.names())
                fake.models = {"data": [{"id": "qwen", "object": "model"}]}
            assert router.candidates("qwen")[0] == [Holder(fake.url, 0), Holder(fake.url, 1)]
            assert service.states[fake.url].models_error is None
        finally:
            await service.stop()
        return seen

    try:
        assert asyncio.run(go()) == [["llama", "sql"], ["qwen"]]
    finally:
        fake.close()
