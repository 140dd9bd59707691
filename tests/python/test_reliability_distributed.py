"""Issue 21's distributed repros and cross-rank agreement, in one spawned gloo
world of two ranks (cases in reliability_distributed_cases.py): zero-size
DTensor params, a writer failing on one rank, settings, loads, groups and
GradScaler use differing across ranks. A hang fails by the join deadline."""

from __future__ import annotations

from support import reliability_distributed_cases as cases
from support.dist_helpers import spawn


def test_every_call_completes_or_raises_on_every_rank(tmp_path):
    spawn(tmp_path, 2, cases.run_all, timeout_s=240)
