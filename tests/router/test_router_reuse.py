"""The router promises only what an engine reuses: of a prompt of n tokens at most
``(n - 1) // B`` blocks, so a block-aligned prompt's last block is never counted as
cached. ``/query``, ``/route`` and the relay's ``x-kvevents-matched-tokens`` say so,
answered natively and in Python (``KVEVENTS_NATIVE=0``), and the simulated engine's own
``cached_tokens`` for the same request agree with them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from router_support import KV_CONFIG, Engine, RouterProc, wait_until

from kvevents.text.chat import render_chat

PAGE = 16
pytestmark = pytest.mark.slow  # an engine and routers as subprocesses


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., Engine]) -> Engine:
    return make_engine(["--dp-size", "2", "--page-size", str(PAGE)], KV_CONFIG)


@pytest.fixture(scope="module", params=["native", "python"])
def router(
    request: pytest.FixtureRequest, make_router: Callable[..., RouterProc], engine: Engine
) -> RouterProc:
    """A router with the whole-request native calls on, or off (the Python path)."""
    env = {} if request.param == "native" else {"KVEVENTS_NATIVE": "0"}
    proc = make_router([engine.url], "--load-interval", "0.2", streams=2, env=env)
    native = _native(proc)
    assert native["status"] == ("loaded" if request.param == "native" else "off: KVEVENTS_NATIVE=0")
    return proc


def _native(router: RouterProc) -> dict[str, Any]:
    state: dict[str, Any] = router.http.get("/workers").json()["process"]["native"]
    return state


def _base(router: RouterProc) -> int:
    """Token ids no other router of this module uses (its port tells them apart)."""
    return 3_000_000 + 1_000 * int(router.url.rsplit(":", 1)[1])


def _query(router: RouterProc, tokens: list[int], rank: int) -> tuple[int, int]:
    """``rank``'s matched blocks and tokens in the router's ``/query`` of ``tokens``."""
    answer = router.post("/query", {"input_ids": tokens}).json()
    (match,) = [m for m in answer["matches"] if m["dp_rank"] == rank]
    return match["matched_blocks"], match["matched_tokens"]


def _held_whole(router: RouterProc, engine: Engine, prompt: list[int], rank: int) -> None:
    """``engine`` stores ``prompt`` (block-aligned) on ``rank``; wait until the router
    sees every block of it, asking with one token more (then every block is reusable)."""
    engine.generate(prompt, rank=rank)
    blocks = len(prompt) // PAGE
    wait_until(
        lambda: _query(router, [*prompt, 1], rank) == (blocks, blocks * PAGE),
        10,
        f"rank {rank}'s {blocks} blocks in the index",
    )


def test_a_block_aligned_prompt_held_whole_is_promised_all_but_its_last_block(
    router: RouterProc, engine: Engine
) -> None:
    """64 tokens at block 16 that a rank holds whole: /query and /route count 3 blocks,
    48 tokens, of 4; a relayed request says 48 matched tokens and the engine reports 48
    cached; 65 tokens of the same blocks are 4 blocks, 64 tokens, on every count."""
    aligned = list(range(_base(router), _base(router) + 64))
    _held_whole(router, engine, aligned, rank=1)
    longer = [*aligned, 7]
    answered = _native(router)["answered"]
    assert _query(router, aligned, 1) == (3, 48)
    assert _query(router, longer, 1) == (4, 64)
    if _native(router)["status"] == "loaded":
        assert _native(router)["answered"] == answered + 2  # both /query answers were native
    for tokens, blocks in ((aligned, 3), (longer, 4)):
        for _ in range(2):  # the second after a change of loads is answered natively
            route = router.post("/route", {"input_ids": tokens}).json()
            assert (route["dp_rank"], route["n_blocks"]) == (1, 4)
            best = route["scores"][0]
            assert best["matched"] == {"gpu": blocks, "cpu": 0, "disk": 0}
            assert best["prefill_blocks"] == 4 - blocks
    for tokens, cached in ((aligned, 48), (longer, 64)):
        relayed = router.post("/v1/completions", {"prompt": tokens, "max_tokens": 1})
        assert relayed.status_code == 200, relayed.text
        assert relayed.headers["x-kvevents-dp-rank"] == "1"
        assert relayed.headers["x-kvevents-matched-tokens"] == str(cached)
        assert relayed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    native = _native(router)
    assert native["failures"] == 0
    if native["status"] == "loaded":
        assert native["calls"]["route"] >= 1 and native["calls"]["query"] >= 2, native
    else:
        assert native["answered"] == native["chosen"] == 0, native


def test_a_batch_counts_each_prompts_reusable_blocks(router: RouterProc, engine: Engine) -> None:
    """A batch of a block-aligned prompt and one a token longer, both held whole on one
    rank: the relay says each prompt's reusable blocks summed are matched, 3 + 4 blocks
    of 8, and the engine reports as many tokens cached."""
    base = _base(router) + 100
    first, second = list(range(base, base + 64)), list(range(base + 500, base + 564))
    _held_whole(router, engine, first, rank=0)
    _held_whole(router, engine, second, rank=0)
    relayed = router.post("/v1/completions", {"prompt": [first, [*second, 9]], "max_tokens": 1})
    assert relayed.status_code == 200, relayed.text
    assert relayed.headers["x-kvevents-dp-rank"] == "0"
    assert relayed.headers["x-kvevents-prompt-tokens"] == "129"
    assert relayed.headers["x-kvevents-matched-tokens"] == str(7 * PAGE)
    assert relayed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * PAGE


def test_text_and_chat_prompts_count_their_tokens_after_tokenizing(router: RouterProc) -> None:
    """A text prompt and a chat whose tokens (bytes, as the engine's tokenizer reads them)
    end on a block boundary, relayed twice: the second time the router says every block
    but the last is matched, and the engine reports exactly that as cached."""
    text = f"reuse {router.url} ".ljust(5 * PAGE, "t")
    assert len(text.encode()) == 5 * PAGE
    content = f"chat {router.url} "
    messages = [{"role": "user", "content": content}]
    while len(render_chat(messages).encode()) % PAGE:
        content += "c"
        messages = [{"role": "user", "content": content}]
    n_chat = len(render_chat(messages).encode())
    for path, body, n in (
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, 5 * PAGE),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}, n_chat),
    ):
        first = router.post(path, body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == n
        rank = int(first.headers["x-kvevents-dp-rank"])
        prompt = list((text if "prompt" in body else render_chat(messages)).encode())
        wait_until(
            lambda p=prompt, r=rank, b=n // PAGE: _query(router, [*p, 1], r)[0] == b,
            10,
            f"{path}'s prompt in the index",
        )
        again = router.post(path, body)
        assert again.status_code == 200, again.text
        assert again.headers["x-kvevents-dp-rank"] == str(rank)
        assert again.headers["x-kvevents-prompt-tokens"] == str(n)
        assert again.headers["x-kvevents-matched-tokens"] == str(n - PAGE)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n - PAGE
