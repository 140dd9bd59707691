"""Distributed MuonAdamW on NCCL, one GPU per rank (marked gpu: skipped
without CUDA; needs two GPUs for W=2). Not yet run on a GPU."""

import pytest
import torch

from support import distributed_cases as cases
from support.dist_helpers import spawn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [1, 2])
def test_nccl_sharded_steps_match_single_gpu(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn(tmp_path, world, cases.run_all, [(cases.cuda_sharded_matches_single_process, (world,))], backend="nccl",
          timeout_s=120)  # inside gpu_check.sh's 240 s test stage, so a hang fails this test, not the stage
