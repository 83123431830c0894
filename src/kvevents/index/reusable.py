"""How many blocks of a prompt an engine can reuse at most: every block but a recomputed last one.

The rule
--------
An engine must compute at least the prompt's last token to get the logits of the first
output token, so it never takes more than ``n_tokens - 1`` tokens from its prefix cache,
and a hit is made of whole blocks. Of a prompt of ``n_tokens`` tokens at most
``(n_tokens - 1) // block_size`` blocks are reused: every full block when the prompt
ends inside a block, and all but the last when it ends on a block boundary (the whole
last block is computed again, not just its last token).

Sources: vLLM's ``KVCacheManager.get_computed_blocks`` (``vllm/v1/core/
kv_cache_manager.py``) asks its coordinator for the longest hit of at most
``request.num_tokens - 1`` tokens, for every request and every coordinator, full
attention or hybrid; SGLang's ``Req`` (``managers/schedule_batch.py``) matches at most
``input_len - 1`` tokens the same way. A real vLLM 0.32 serving a block-aligned prompt of
six 32-token blocks a second time reports 160 cached tokens, five blocks
(``tests/data/wire-samples/vllm-0.32.0-cpu-hybrid-gemma3.jsonl``). The rule is the
engines', for every prompt, so the index applies it to every holder, not hybrid ones
only: :meth:`~kvevents.index.prefix_index.PrefixIndex.match` always, ``match_keys`` when
its caller passes ``reusable=`` (a request's keys alone do not say whether the prompt
ended on a block boundary).

Why it matters most for hybrid models
-------------------------------------
For full attention the rule costs a block-aligned prompt one block, the same for every
holder that has the whole prompt. For a hybrid model vLLM's coordinator starts its fixed
point (:func:`kvevents.index.groups.reuse_length`) from the capped length, so the
sliding window must be held before the capped end, not the prompt's: a holder whose
window covers only the prompt's last blocks (what a longer prompt with the same start
left) reuses none of it. In the capture above, vLLM's sliding-window group stored for a
block-aligned prompt the window before its capped end, not its last blocks. The index
therefore applies the cap before the groups shorten a match
(:meth:`kvevents.index.mask_table.MaskTable.match_keys`, ``reusable=``), never after.
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
