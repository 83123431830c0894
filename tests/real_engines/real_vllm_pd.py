"""What the P/D tests share: a real vLLM prefill instance and decode instance, the
``kvevents router --prefill ... --decode ...`` in front of them, and vLLM's own counters.

``scripts/test-real-vllm --pd`` starts both instances with KV events and vLLM's
``ExampleConnector`` on one shared folder, and exports each one's variables with its own
prefix (``KVEVENTS_REAL_VLLM_PREFILL_URL``, ``KVEVENTS_REAL_VLLM_DECODE_URL``...) plus
``KVEVENTS_REAL_VLLM_PD_SHARED`` (the folder), which marks a P/D run.

The score is what vLLM says, never what the router says of itself: per instance and per
data-parallel rank (the ``engine`` label), ``vllm:request_success_total`` (requests
finished) and ``vllm:prompt_tokens_by_source_total`` (prompt tokens computed here,
found in the local prefix cache, or read from the KV transfer), scraped from each
``/metrics``. vLLM counts them as its answers go out, so a snapshot after a request is
taken by :meth:`PDFleet.settle`, which waits (bounded) until the finished-request counts
reach what the test expects and fails as soon as they pass it. :func:`send` is one
request through the router with both snapshots around it (:class:`Sent`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
from prometheus_client.parser import text_string_to_metric_families
from real_vllm_helpers import ENV_PREFIX, SCRIPT, RealVLLM
from real_vllm_router import Routed, RouterProcess, words

ENV_PD = ENV_PREFIX + "PD_SHARED"
PREFILL_PREFIX = ENV_PREFIX + "PREFILL_"
DECODE_PREFIX = ENV_PREFIX + "DECODE_"
SETTLE_TIMEOUT_S = 15.0
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class VLLMCounters:
    """One scrape of a vLLM's ``/metrics``, per data-parallel rank: requests finished
    (every ``finished_reason``) and prompt tokens by source (:data:`SOURCES`)."""

    requests: Mapping[int, float]
    prompt_tokens: Mapping[tuple[int, str], float]

    @classmethod
    def scrape(cls, url: str) -> VLLMCounters:
        text = httpx.get(f"{url}/metrics", timeout=30.0).text
        requests: dict[int, float] = {}
        tokens: dict[tuple[int, str], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:request_success_total":
                    rank = int(sample.labels["engine"])
                    requests[rank] = requests.get(rank, 0.0) + sample.value
                elif sample.name == "vllm:prompt_tokens_by_source_total":
                    rank = int(sample.labels["engine"])
                    key = (rank, sample.labels["source"])
                    tokens[key] = tokens.get(key, 0.0) + sample.value
        return cls(requests=requests, prompt_tokens=tokens)

    def since(self, before: VLLMCounters) -> VLLMCounters:
        """What changed from ``before`` to this scrape (ranks and sources that did not
        change are left out)."""
        requests = {
            r: n - before.requests.get(r, 0.0)
            for r, n in self.requests.items()
            if n != before.requests.get(r, 0.0)
        }
        tokens = {
            k: n - before.prompt_tokens.get(k, 0.0)
            for k, n in self.prompt_tokens.items()
            if n != before.prompt_tokens.get(k, 0.0)
        }
        return VLLMCounters(requests=requests, prompt_tokens=tokens)

    def tokens(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s prompt tokens by source (every source, 0 when none)."""
        return {s: int(self.prompt_tokens.get((rank, s), 0.0)) for s in SOURCES}


@dataclass(frozen=True)
class Ledger:
    """Both instances' counters and the router's P/D counters, at one moment."""

    prefill: VLLMCounters
    decode: VLLMCounters
    router: Mapping[str, int]  # flattened /workers "pd" counters (see router_pd_counts)


def router_pd_counts(workers: Mapping[str, Any]) -> dict[str, int]:
    """``/workers``' ``pd`` counters, flattened: ``prefill.requests``,
    ``prefill.chosen_by_cache``, ``decode.prefill_skipped``, ``decode.legs_failed.status``..."""
    out: dict[str, int] = {}
    for pool, section in workers["pd"]["pools"].items():
        for key, value in section.items():
            if isinstance(value, dict):
                out.update({f"{pool}.{key}.{k}": int(v) for k, v in value.items()})
            elif isinstance(value, int) and not isinstance(value, bool):
                out[f"{pool}.{key}"] = value
    return out


def router_pd_metrics(text: str) -> dict[str, int]:
    """The router's ``kvevents_router_pd_*`` counters, named as :func:`router_pd_counts`
    names the ``/workers`` ones they must equal."""
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            value = int(s.value)
            if s.name == "kvevents_router_pd_requests_total":
                out[f"{s.labels['pool']}.requests"] = value
            elif s.name == "kvevents_router_pd_prefill_skipped_total":
                out["decode.prefill_skipped"] = value
            elif s.name == "kvevents_router_pd_prefill_chosen_total":
                out[f"prefill.chosen_by_{s.labels['reason']}"] = value
            elif s.name == "kvevents_router_pd_legs_failed_total":
                out[f"{s.labels['pool']}.legs_failed.{s.labels['reason']}"] = value
    return out


@dataclass(frozen=True)
class PDFleet:
    """The prefill and decode instances, as the script described them."""

    prefill: RealVLLM
    decode: RealVLLM
    shared_dir: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PDFleet:
        env = os.environ if env is None else env
        if not env.get(ENV_PD):
            raise RuntimeError(f"{ENV_PD} not set: run the suite with {SCRIPT} --pd")
        return cls(
            prefill=RealVLLM.from_env(env, PREFILL_PREFIX),
            decode=RealVLLM.from_env(env, DECODE_PREFIX),
            shared_dir=env[ENV_PD],
        )

    @property
    def block_size(self) -> int:
        return self.decode.block_size

    def start_router(
        self, *extra: str, log: Path | None = None, ask_engine: bool = False
    ) -> RouterProcess:
        """``kvevents router --prefill P ... --decode D ... --tokenizer MODEL``, each
        instance described by flags only, as the README tells a vLLM user; stop it after.
        ``ask_engine``: tokenize with the decode's ``/tokenize`` instead, which renders
        chats with the instance's template (the model folder's tokenizer has none)."""
        if ask_engine:
            tokenizer = ["--tokenize-endpoint", f"{self.decode.url}/tokenize"]
        else:
            tokenizer = ["--tokenizer", self.prefill.model]
        return RouterProcess(
            self.prefill.url,
            self.prefill.router_engine_args(),
            *tokenizer,
            *extra,
            log=log or Path(self.decode.state_dir).parent / "router-pd.log",
            decode=[self.decode.url, *self.decode.router_engine_args()],
        )

    def ledger(self, router: RouterProcess) -> Ledger:
        return Ledger(
            prefill=VLLMCounters.scrape(self.prefill.url),
            decode=VLLMCounters.scrape(self.decode.url),
            router=router_pd_counts(router.workers()),
        )

    def settle(
        self,
        router: RouterProcess,
        before: Ledger,
        *,
        prefill: Mapping[int, int],
        decode: Mapping[int, int],
        timeout: float = SETTLE_TIMEOUT_S,
    ) -> Ledger:
        """The ledger once each instance's finished requests per rank have grown by exactly
        ``prefill`` / ``decode`` (rank -> requests) since ``before``; AssertionError when
        a count passes its mark, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        want = {"prefill": dict(prefill), "decode": dict(decode)}
        while True:
            now = self.ledger(router)
            seen = {
                "prefill": _whole(now.prefill.since(before.prefill).requests),
                "decode": _whole(now.decode.since(before.decode).requests),
            }
            if seen == want:
                return now
            for pool in want:
                for rank, n in seen[pool].items():
                    assert n <= want[pool].get(rank, 0), (
                        f"vLLM's {pool} instance finished {n} requests on rank {rank}, "
                        f"expected {want[pool].get(rank, 0)} (all: {seen})"
                    )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"vLLM's finished requests per rank stayed {seen} for {timeout:.0f} s, "
                    f"expected {want}"
                )
            time.sleep(0.1)


def _whole(counts: Mapping[int, float]) -> dict[int, int]:
    return {rank: int(n) for rank, n in counts.items()}


def router_delta(after: Ledger, before: Ledger) -> dict[str, int]:
    """The router's P/D counters that changed between two ledgers."""
    keys = after.router.keys() | before.router.keys()
    delta = {k: after.router.get(k, 0) - before.router.get(k, 0) for k in keys}
    return {k: v for k, v in delta.items() if v}


@dataclass(frozen=True)
class Sent:
    """One request through the router, and the counters around it."""

    routed: Routed
    prefill_rank: int | None  # None: the decode served it alone
    decode_rank: int
    before: Ledger
    after: Ledger

    @property
    def prefilled(self) -> VLLMCounters:
        """What the prefill instance counted for it."""
        return self.after.prefill.since(self.before.prefill)

    @property
    def decoded(self) -> VLLMCounters:
        """What the decode instance counted for it."""
        return self.after.decode.since(self.before.decode)

    @property
    def router_counted(self) -> dict[str, int]:
        """The router's P/D counters that changed for it."""
        return router_delta(self.after, self.before)


def send(
    fleet: PDFleet,
    router: RouterProcess,
    prompt: Sequence[int],
    *,
    prefill: str,
    max_tokens: int = 1,
    stream: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> Sent:
    """``prompt`` as text through the router's ``/v1/completions`` (``extra``: more
    members of its body); checks it answered 200
    from the decode instance, with ``x-kvevents-prefill: prefill`` (``skipped``, or the
    reason a prefill holder was chosen) and the prefill instance named when there was one,
    and that vLLM finished one request on each leg's rank and changed no other rank's
    counters."""
    before = fleet.ledger(router)
    routed = router.complete(words(prompt), max_tokens=max_tokens, stream=stream, extra=extra)
    assert routed.status == 200, routed.body
    h = routed.headers
    assert h.get("x-kvevents-prefill") == prefill, dict(h)
    assert unquote(routed.worker) == fleet.decode.url
    p_rank: int | None = None
    if prefill == "skipped":
        assert "x-kvevents-prefill-worker" not in h
    else:
        assert unquote(h["x-kvevents-prefill-worker"]) == fleet.prefill.url
        p_rank = int(h["x-kvevents-prefill-dp-rank"])
    d_rank = routed.dp_rank
    after = fleet.settle(
        router, before, prefill={} if p_rank is None else {p_rank: 1}, decode={d_rank: 1}
    )
    sent = Sent(routed, p_rank, d_rank, before, after)
    assert {r for r, _ in sent.prefilled.prompt_tokens} <= (set() if p_rank is None else {p_rank})
    assert {r for r, _ in sent.decoded.prompt_tokens} <= {d_rank}
    return sent


def wait_totals(
    fleet: PDFleet, since: Ledger, expected: tuple[int, int], timeout: float = SETTLE_TIMEOUT_S
) -> None:
    """Until the requests each instance finished since ``since`` are ``expected``
    (prefill, decode); AssertionError with the last totals after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        totals = (
            int(sum(VLLMCounters.scrape(fleet.prefill.url).since(since.prefill).requests.values())),
            int(sum(VLLMCounters.scrape(fleet.decode.url).since(since.decode).requests.values())),
        )
        if totals == expected:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"vLLM finished {totals} (prefill, decode) requests since the router started; "
                f"the router sent {expected}"
            )
        time.sleep(0.1)
