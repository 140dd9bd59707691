"""Entry points: installed packages that hook into every MuonAdamW (e.g. register
param writers for their params), found through the entry-point group
"muon_ext.adapters" and called as `adapter(optimizer)` after construction."""

from __future__ import annotations

from importlib import metadata
from typing import List

__all__ = ["ENTRY_POINT_GROUP", "installed", "bind_installed"]

ENTRY_POINT_GROUP = "muon_ext.adapters"


def installed() -> List[metadata.EntryPoint]:
    """The installed adapters' entry points, in name order (a stable binding order)."""
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value))


def bind_installed(optimizer) -> None:
    """Loads each installed adapter and calls it with `optimizer`; the first
    that fails to load or raises fails construction, naming its entry point."""
    for entry_point in installed():
        try:
            entry_point.load()(optimizer)
        except Exception as exc:
            raise RuntimeError(f"muon_ext adapter '{entry_point.name}' ({entry_point.value}) failed while binding "
                               f"to the optimizer: {type(exc).__name__}: {exc}") from exc
