"""How many blocks of a prompt an engine can reuse at most: every block but a recomputed last one.

An engine must compute at least the prompt's last token to get the logits of the first
output token, so it takes at most ``n_tokens - 1`` tokens from its prefix cache, in whole
blocks: of a prompt of ``n_tokens`` tokens at most ``(n_tokens - 1) // block_size``
blocks are reused, which for a prompt ending on a block boundary is all but the last
(the whole last block is computed again). vLLM (``KVCacheManager.get_computed_blocks``)
and SGLang (``Req``'s prefix match) both cap the hit so, for every request, and the
captured vLLM sample ``tests/data/wire-samples/vllm-0.32.0-cpu-hybrid-gemma3.jsonl``
shows it; so the index applies the cap to every holder:
:meth:`~kvevents.index.prefix_index.PrefixIndex.match` always, ``match_keys`` when its
caller passes ``reusable=`` (keys alone do not say where the prompt ended).

Who applies it: the router, to every match it reports or scores
(:class:`~kvevents.router.decide.router.Router` passes ``reusable=``; the native core
computes the same cap from the token count); the simulated engine, to its cache hits and
a decode's received blocks (:mod:`kvevents.engine.cache`, :mod:`kvevents.engine.scheduler`);
the demo's bounds (:mod:`kvevents.demo.pd_figures`). What is keyed, stored and predicted
stays every full block: an engine stores them all once it has computed the prompt.

For full attention the cap costs a block-aligned prompt one block, the same for every
holder. For a hybrid model it matters more: vLLM starts its fixed point
(:func:`kvevents.index.groups.reuse_length`) from the capped length, so the sliding
window must be held before the capped end, not the prompt's. The index therefore
applies the cap before the groups shorten a match
(:meth:`kvevents.index.mask_table.MaskTable.match_keys`), never after.
"""

from __future__ import annotations

__all__ = ["reusable_blocks"]


def reusable_blocks(n_tokens: int, block_size: int) -> int:
    """The most blocks an engine reuses of a prompt of ``n_tokens`` tokens (module docstring).

    ``(n_tokens - 1) // block_size``, 0 for an empty prompt. ValueError for a block size
    that is not a positive int.
    """
    if block_size <= 0:
        raise ValueError(f"reusable_blocks: block_size={block_size} must be a positive int")
    return (n_tokens - 1) // block_size if n_tokens > 0 else 0
