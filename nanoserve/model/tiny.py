"""The tiny bundled model: a real byte-level BPE tokenizer and a small Llama, needing no download.

It lives in `nanoserve/assets/tiny-llama/` (about 5 MB) and was made by
`scripts/make_tiny_model.py`: 2.4 M parameters, 4 layers, grouped-query attention (6 query heads,
2 KV heads), llama3 rope scaling, tied embeddings, trained for a few minutes on the Python
standard library's documentation. Pass `--model tiny` (the default) to any nanoserve command.
"""

from __future__ import annotations

from pathlib import Path

TINY_MODEL_DIR = Path(__file__).parents[1] / "assets" / "tiny-llama"


def tiny_model_dir() -> Path:
    if not (TINY_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the bundled tiny model is missing from {TINY_MODEL_DIR}; reinstall nanoserve, "
            "or rebuild it with `python scripts/make_tiny_model.py`"
        )
    return TINY_MODEL_DIR
