"""A batch of prompts (one ``/v1/completions`` request) placed on one holder.

OpenAI's completions take ``prompt`` as a list of prompts. The router keeps such a
request whole and sends it to the one holder whose cost for the whole batch is
lowest: the sum, over the prompts, of each prompt's cost on that holder as
:mod:`kvevents.router.decide.scoring` computes it for a request of its own.

Why one holder rather than one request per prompt: the batch is one request to the
client (one ``id``, one stream, ``n`` completions per prompt, usage for the whole), and
an engine answers it with every prompt's choices in order; forwarded whole, the
engine's answer goes back byte for byte, streaming included, with no re-numbering of
``choices[i].index`` or merging of streams and usage that could go wrong. Batches are
usually built from one template (few-shot prompts sharing their head), so the holder
that caches the shared prefix is the right one for all of them, and the summed cost
says so. What is lost: prompts of one batch with unrelated prefixes cached on
different ranks are not each sent to their own rank; a client that wants that sends
one request per prompt.

:func:`combine_scores` is pure and O(prompts x holders).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvevents.index.types import HolderMatch
from kvevents.router.decide.scoring import HolderScore
from kvevents.types import Holder

__all__ = ["combine_scores"]


def combine_scores(
    per_prompt: Sequence[Sequence[HolderScore]], holders: Sequence[Holder]
) -> list[HolderScore]:
    """Each holder's scores summed over the prompts, ranked as :func:`~kvevents.router.decide.scoring.score` ranks.

    ``per_prompt`` holds, per prompt, every holder of ``holders`` scored once (in any
    order). Summed: ``matched`` (per tier), ``cached_blocks``, ``prefill_blocks``,
    ``predicted_blocks`` and ``cost``; the holder's own figures (``pending_blocks``,
    ``recent_blocks``, ``balance_blocks``, ``routed``, ``available``) are the same in
    every prompt's score and kept. Ties go as in ``score``: lower pending, then lower
    recent, then fewer routed, then the earlier holder of ``holders``.
    """
    order = {h: i for i, h in enumerate(holders)}
    sums: dict[Holder, list[float]] = {}
    first: dict[Holder, HolderScore] = {}
    for scores in per_prompt:
        for s in scores:
            h = s.holder
            acc = sums.get(h)
            m = s.matched
            if acc is None:
                first[h] = s
                sums[h] = [m.gpu, m.cpu, m.disk, s.cached_blocks, s.prefill_blocks, s.cost,
                           s.predicted_blocks]  # fmt: skip
                continue
            acc[0] += m.gpu
            acc[1] += m.cpu
            acc[2] += m.disk
            acc[3] += s.cached_blocks
            acc[4] += s.prefill_blocks
            acc[5] += s.cost
            acc[6] += s.predicted_blocks
    out = []
    for h, acc in sums.items():
        s = first[h]
        out.append(
            HolderScore(
                worker=s.worker,
                dp_rank=s.dp_rank,
                matched=HolderMatch(int(acc[0]), int(acc[1]), int(acc[2])),
                cached_blocks=acc[3],
                prefill_blocks=acc[4],
                pending_blocks=s.pending_blocks,
                cost=acc[5],
                routed=s.routed,
                available=s.available,
                recent_blocks=s.recent_blocks,
                balance_blocks=s.balance_blocks,
                predicted_blocks=int(acc[6]),
            )
        )
    out.sort(
        key=lambda s: (
            not s.available,
            s.cost,
            s.pending_blocks,
            s.recent_blocks,
            s.routed,
            order.get(s.holder, len(order)),
        )
    )
    return out
