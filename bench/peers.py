"""Peers measured beside muon_ext in the same process: the seed's MuonAdamW
(../shared/peers/hydra_muonadamw.py, when that checkout sits beside this one)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SEED_PATH = Path(__file__).resolve().parents[2] / "shared" / "peers" / "hydra_muonadamw.py"


def load_seed(compiled: bool):
    """The seed's module, with torch.compile on or off; None when ../shared is absent."""
    if not SEED_PATH.exists():
        return None
    os.environ["HYDRA_MUON_COMPILE"] = "1" if compiled else "0"
    spec = importlib.util.spec_from_file_location(f"hydra_muonadamw_{'compiled' if compiled else 'eager'}", SEED_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
