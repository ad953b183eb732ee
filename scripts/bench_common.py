"""What every benchmark script records next to its numbers: the machine, the software, the date."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def save_result(out_dir: str | Path, name: str, **fields) -> Path:
    """Write `fields` plus the GPU, torch version and date to `out_dir/name.json`."""
    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"), **fields)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(meta, indent=2))
    print(f"wrote {path}")
    return path
