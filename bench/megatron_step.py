"""Benchmark: muon_ext.megatron (MuonAdamW as Megatron-Core's optimizer) against
Megatron-Core's own bf16 Adam (get_megatron_optimizer: FP32 main params + two
FP32 moments) on a small GPTModel under Megatron DDP, TP = 1 and 2 on a
2-process gloo world (CPU; megatron-core's CUDA calls mapped to the CPU by the
test-only patch tests/python/support/megatron_cpu.py).

Reports per (optimizer, TP, tp_mode): seconds per optimizer step (median of
the timed steps, slowest rank), and optimizer-state bytes per BF16 model
param on this rank (every tensor the optimizer keeps beyond the model's
params and DDP's grad buffers: moments, FP32 main params or int16 remainders).
Megatron's Muon needs `emerging_optimizers` (not on the package registry): it is
reported as unavailable unless importable.
Usage: python bench/megatron_step.py [--hidden 64] [--steps 6] [--out bench/results/megatron.json]
(Not bench/megatron.py: a script of that name would shadow the megatron package.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, ROOT)

CASES = [("muon_ext", 1, "duplicated"), ("muon_ext", 2, "duplicated"), ("muon_ext", 2, "distributed"),
         ("muon_ext", 2, "blockwise"), ("megatron_adam", 1, None), ("megatron_adam", 2, None)]


def state_bytes(opt) -> int:
    """Bytes of every tensor the optimizer holds beyond the model's params (local parts, each storage range once;
    Megatron's ChainedOptimizer: over its parts, FP32 main params included)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.numel():
            key = (t.data_ptr(), t.numel(), t.element_size())  # to_local() makes new objects: ids are reused
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()

    for part in getattr(opt, "chained_optimizers", [opt]):
        for entry in part.optimizer.state.values():
            for value in entry.values():
                add(value)
        for group in getattr(part, "fp32_from_float16_groups", []):  # Megatron's FP32 main params
            for p in group:
                add(p)
    return total


def run_case(kind: str, tp: int, mode, hidden: int, steps: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from muon_ext.megatron import get_megatron_muon_optimizer
    from support.megatron_model import forward_backward, init_parallel, tiny_gpt

    init_parallel(tp)
    model = tiny_gpt(hidden=hidden, heads=4, layers=2)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0, muon_split_qkv=True,
                             muon_tp_mode=mode or "blockwise")
    opt = get_megatron_muon_optimizer(config, [model]) if kind == "muon_ext" else \
        get_megatron_optimizer(config, [model])
    times, losses = [], []
    for s in range(steps):
        losses.append(forward_backward(model, s))
        torch.distributed.barrier()
        start = time.perf_counter()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        times.append(elapsed.item())
    params = sum(p.numel() for p in model.parameters())
    return {"optimizer": kind, "tp": tp, "tp_mode": mode, "params_on_rank": params,
            "step_s": statistics.median(times[1:]), "state_bytes_per_param": state_bytes(opt) / params,
            "final_loss": losses[-1]}


def _worker(rank, world, store, args, out):
    import datetime

    import torch.distributed as dist

    from support.megatron_cpu import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = []
    with megatron_on_cpu():
        for kind, tp, mode in CASES:
            results.append(run_case(kind, tp, mode, args.hidden, args.steps))
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
    if rank == 0:
        import json
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "megatron.json"))
    args = parser.parse_args()
    if importlib.util.find_spec("megatron") is None:
        sys.exit("megatron-core is not installed: pip install '.[megatron]'")
    import json

    import torch.multiprocessing as mp

    from common import environment, write_json

    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "results.json")
    mp.start_processes(_worker, args=(2, os.path.join(tmp, "store"), args, out), nprocs=2, start_method="spawn")
    with open(out) as f:
        results = json.load(f)
    megatron_muon = importlib.util.find_spec("emerging_optimizers") is not None
    write_json(args.out, {"environment": environment(torch.device("cpu")), "hidden": args.hidden,
                          "world": 2, "megatron_muon": "available (not run)" if megatron_muon else
                          "unavailable: emerging_optimizers is not installed", "results": results})


if __name__ == "__main__":
    main()
