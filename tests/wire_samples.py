"""The captured SGLang and vLLM wire samples bundled under tests/data/wire-samples.

A plain module (not conftest) so that tests in any folder can import it by name.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Copies of ../shared/wire-samples (real SGLang 0.5.23 and vLLM 0.32 captures, one of them
# of a hybrid-attention Gemma3), kept in the repository so the tests run on a fresh machine.
WIRE_SAMPLES = Path(__file__).resolve().parent / "data" / "wire-samples"
SAMPLE_FILES = (
    "sglang-0.5.23.jsonl",
    "vllm-0.32.0-cpu-int-hashes.jsonl",
    "vllm-0.32.0-cpu-bytes-hashes.jsonl",
    "vllm-0.32.0-cpu-hybrid-gemma3.jsonl",
)


def load_wire_samples(name: str) -> list[dict]:
    """Every captured message of one sample file, frames as bytes."""
    path = WIRE_SAMPLES / name
    if not path.exists():
        raise FileNotFoundError(
            f"wire sample {path} is missing: restore tests/data/wire-samples from git"
        )
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        record["frames"] = [bytes.fromhex(x) for x in record["frames_hex"]]
        out.append(record)
    return out
