"""Peers measured beside muon_ext in the same process: the seed's MuonAdamW
(shared/peers/hydra_muonadamw.py inside the checkout, git-ignored, which is how
it reaches a device machine; else ../shared/peers/ beside the checkout)."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

_SEED_CANDIDATES = [Path(__file__).resolve().parents[level] / "shared" / "peers" / "hydra_muonadamw.py"
                    for level in (1, 2)]
SEED_PATH = next((path for path in _SEED_CANDIDATES if path.exists()), _SEED_CANDIDATES[-1])


@functools.lru_cache(maxsize=None)
def load_seed(compiled: bool):
    """The seed's module, with torch.compile on or off; None when ../shared is absent.
    Loaded once per mode, so its compiled functions are reused across stacks."""
    if not SEED_PATH.exists():
        return None
    os.environ["HYDRA_MUON_COMPILE"] = "1" if compiled else "0"
    spec = importlib.util.spec_from_file_location(f"hydra_muonadamw_{'compiled' if compiled else 'eager'}", SEED_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
