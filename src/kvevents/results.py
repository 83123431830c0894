"""Results files: JSON that every benchmark and the demo write the same way."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["finite_json", "write_results"]


def finite_json(value: Any) -> Any:
    """``value`` with every infinite or NaN float replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def write_results(path: Path, doc: Any) -> None:
    """Write a benchmark's results as indented JSON (non-finite floats as null), making the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite_json(doc), indent=2) + "\n")
