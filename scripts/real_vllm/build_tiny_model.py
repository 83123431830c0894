"""Build a tiny, randomly initialised Llama (or hybrid Gemma3) and a word-level tokenizer.

Runs with the vLLM virtual environment's Python (it needs ``torch``, ``transformers`` and
``tokenizers``, which vLLM brings), never with the project's own Python:

    VENV/bin/python scripts/real_vllm/build_tiny_model.py OUT_DIR [--kind llama|hybrid]

``--kind hybrid`` builds a hybrid-attention model instead: a Gemma3 text model
(architecture ``Gemma3ForCausalLM``) with one sliding-window layer (window 64) and one
full-attention layer, the same sizes otherwise, so vLLM keeps two KV-cache groups and
publishes each group's blocks with ``group_idx`` and ``kv_cache_spec_kind``.

Why these numbers: vLLM's CPU attention kernel refuses head sizes below 32, so two heads
of 32 make the hidden size 64; two layers keep loading short. The weights are random
(seeded), so generated text is noise; what matters here is the engine's prefix cache and
its KV events, which depend only on token ids.

Vocabulary: four special tokens (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3) and the
words ``w4`` .. ``w{VOCAB_SIZE-1}``, so word ``wN`` is token id ``N``: a test can write a
prompt as text and know its token ids without calling the tokenizer.

The folder is complete for ``HF_HUB_OFFLINE=1``: ``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` / ``special_tokens_map.json``. A ``kvevents-model.json`` stamp
is written last, so a folder without it is an interrupted build and is rebuilt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

VOCAB_SIZE = 1024
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
STAMP = "kvevents-model.json"
# Bump when anything below changes, so cached folders are rebuilt.
RECIPE = {
    "recipe": 1,
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "seed": 0,
}


def build_tokenizer(out: Path) -> None:
    """Word-level tokenizer over whitespace-separated words; unknown words map to ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=RECIPE["max_position_embeddings"],
    )
    # No BOS is added: a text prompt's token ids are exactly its words' ids.
    fast.save_pretrained(out)


def build_model(out: Path) -> None:
    """A 2-layer Llama with seeded random weights, saved as safetensors."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(RECIPE["seed"])
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=4 * RECIPE["hidden_size"],
        num_hidden_layers=RECIPE["num_layers"],
        num_attention_heads=RECIPE["num_heads"],
        num_key_value_heads=RECIPE["num_heads"],
        head_dim=RECIPE["head_dim"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(out)


HYBRID_RECIPE = {
    **RECIPE,
    "recipe": 1,
    "kind": "hybrid",
    "architecture": "Gemma3ForCausalLM",
    "intermediate_size": 128,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"],
}


def build_hybrid_model(out: Path) -> None:
    """Gemma3 text, one sliding-window layer and one full-attention layer, seeded random weights."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig

    torch.manual_seed(RECIPE["seed"])
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=HYBRID_RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_layers"],
        num_attention_heads=RECIPE["num_heads"],
        num_key_value_heads=RECIPE["num_heads"],
        head_dim=RECIPE["head_dim"],
        sliding_window=HYBRID_RECIPE["sliding_window"],
        layer_types=HYBRID_RECIPE["layer_types"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to create (replaced if incomplete)")
    parser.add_argument(
        "--kind", choices=("llama", "hybrid"), default="llama", help="which tiny model"
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    recipe = HYBRID_RECIPE if args.kind == "hybrid" else RECIPE
    stamp = out / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        print(f"tiny model already built in {out}")
        return 0
    if out.exists():
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp)
    (build_hybrid_model if args.kind == "hybrid" else build_model)(tmp)
    (tmp / STAMP).write_text(json.dumps(recipe))
    tmp.rename(out)
    print(f"tiny model built in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
