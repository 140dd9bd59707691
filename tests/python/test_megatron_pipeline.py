"""muon_ext.megatron under Megatron-Core pipeline parallelism (PP = 2) on gloo: megatron-core's 1F1B
schedule trains a tiny GPT with a stage per process, and the interleaved schedule with 2 virtual stages
(model chunks) per process; its params, grad norm (over the PP group), zero count and clipped steps
equal the one-process run's; a dist_checkpointing save of the one-process run resumes at PP = 2
(support/megatron_pipeline_cases.py)."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from support import megatron_pipeline_cases as cases  # noqa: E402
from support.dist_helpers import spawn  # noqa: E402


def test_pp2_equals_one_process(tmp_path):
    spawn(tmp_path, 1, cases.run_all, [(cases.one_process, (str(tmp_path),))], timeout_s=300)
    spawn(tmp_path, 2, cases.run_all, [(cases.two_stages, (str(tmp_path), 1)),
                                        (cases.two_stages, (str(tmp_path), 2)),
                                        (cases.resumed_at_two_stages, (str(tmp_path),))], timeout_s=300)
