"""The call-sequence property test at W = 2 (docs/design.md, "Every call
completes or changes nothing"): seeded random sequences of step,
update_param, register / unregister writers, state_dict / load_state_dict,
add_param_group, params made non-contiguous and group settings edited (on both
ranks, or on one only: the next step is refused on both) between calls, over
DTensor params (Shard(0), Replicate) and plain ones, with calls that fail on
one rank only; both ranks draw the same sequence. Checked after every call on every
rank against a single-process reference (support/sequence_dist_cases.py).
One spawned gloo world; the CI profile runs 16 sequences of up to 20 calls,
MUON_EXT_LONG_SEQUENCES=1 runs 150 of up to 40 (`-s` prints the counts)."""

from __future__ import annotations

import json
import os

from support import sequence_dist_cases as cases
from support.dist_helpers import spawn

LONG = os.environ.get("MUON_EXT_LONG_SEQUENCES") == "1"
SEQUENCES, CALLS = (150, 40) if LONG else (16, 20)


def test_every_call_completes_like_the_reference_or_changes_nothing_on_every_rank(tmp_path):
    stats_path = tmp_path / "sequence_stats.json"
    first_seed = int(os.environ.get("MUON_EXT_SEQUENCE_SEED", "0"))
    spawn(tmp_path, 2, cases.run_sequences, first_seed, SEQUENCES, CALLS, str(stats_path),
          timeout_s=3600 if LONG else 240)
    stats = json.loads(stats_path.read_text())
    print(f"\nW=2 call sequences (rank 0): {stats}")
    assert stats["sequences"] == SEQUENCES
    assert stats["completed"] and stats["raised"]  # both outcomes were exercised
