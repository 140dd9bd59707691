"""Benchmark: distributed MuonAdamW at W = 1, 2, 4 processes (gloo on CPU,
NCCL with --device cuda and one GPU per rank), against the naive approach in
the same run: every rank gathers every matrix's grad with `full_tensor()`,
orthogonalizes all of them (the single-process fused step on full copies) and
keeps its block. Layouts (--layout): "fsdp": Shard(0) on a 1-D mesh (FSDP2);
"tp": alternately Shard(0) and Shard(1) on a 1-D mesh (column- and
row-parallel weights); "fsdp_tp": a (W/2, 2) mesh with torchtitan's FSDP x TP
placements, alternately (_StridedShard(0), Shard(0)) and (Shard(0), Shard(1)).

Reports per W: seconds per step (median of interleaved rounds, the slowest
rank), bytes each rank sends per step (ours: measured by the optimizer; naive:
the all_gather of every grad, local rows x (W - 1)), and Polar-Express FLOPs
per rank (the most loaded rank, counted by the optimizer; per iteration
4 m^2 n + 2 m^3 for an m x n matrix with m <= n). Both optimizers produce the
same params (checked).
Usage: python bench/distributed.py [--device cuda] [--layout fsdp|tp|fsdp_tp] [--out bench/results/distributed.json]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import environment, write_json

SHAPES = [(128, 256)] * 6 + [(256, 128)] * 3 + [(192, 192)] * 2  # Muon matrices (CPU run about a minute)
NS_STEPS = 5


def polar_flops(rows: int, cols: int) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def _placements(layout: str, j: int):
    """(mesh shape, placements of matrix j) for `layout` at the current world size."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    world = dist.get_world_size()
    if layout == "fsdp":
        return (world,), [Shard(0)]
    if layout == "tp":
        return (world,), [Shard(j % 2)]
    if world < 2:
        return (1, 1), [Shard(0), Shard(0)]
    strided = _StridedShard(0, split_factor=2)
    return (world // 2, 2), ([strided, Shard(0)] if j % 2 == 0 else [Shard(0), Shard(1)])


def _worker(rank, world, port, device_type, out, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from muon_ext import MuonAdamW

    torch.set_num_threads(1)  # one core per rank (W = 4 oversubscribes a 2-core host; see the README)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh(device_type, _placements(layout, 0)[0])
    place = [_placements(layout, j)[1] for j in range(len(SHAPES))]
    gen = torch.Generator().manual_seed(0)
    values = [(0.02 * torch.randn(s, generator=gen)).to(device_type) for s in SHAPES]
    grads = [torch.randn(s, generator=gen).to(device_type) for s in SHAPES]
    ours = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, pl, src_data_rank=None))
            for v, pl in zip(values, place)]
    for p, g, pl in zip(ours, grads, place):
        p.grad = distribute_tensor(g, mesh, pl, src_data_rank=None)
    opt = MuonAdamW([{"params": ours, "kind": "muon", "lr": 0.02}])
    # Naive: every rank keeps full copies, gathers each grad, steps all matrices, keeps its rows.
    naive_params = [torch.nn.Parameter(distribute_tensor(v.clone(), mesh, pl, src_data_rank=None))
                    for v, pl in zip(values, place)]
    for p, g, pl in zip(naive_params, grads, place):
        p.grad = distribute_tensor(g, mesh, pl, src_data_rank=None)
    full = [torch.nn.Parameter(v.clone()) for v in values]
    naive_opt = MuonAdamW([{"params": full, "kind": "muon", "lr": 0.02}])

    def naive_step():
        for f, p in zip(full, naive_params):
            f.grad = p.grad.full_tensor()
        naive_opt.step()
        for f, p, pl in zip(full, naive_params, place):
            p.detach().to_local().copy_(distribute_tensor(f.detach(), mesh, pl, src_data_rank=None).to_local())

    def sync():
        if device_type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    fns = {"ours": opt.step, "naive": naive_step}
    for fn in fns.values():  # warm-up
        timed(fn)
    before = opt._distributed.bytes_sent  # noqa: SLF001 - the bench reads the optimizer's counters
    flops_before = opt._distributed.polar_flops  # noqa: SLF001
    samples = {name: [] for name in fns}
    rounds = 5
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    bytes_ours = (opt._distributed.bytes_sent - before) / rounds  # noqa: SLF001
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(ours, naive_params))
    flops_ours = (opt._distributed.polar_flops - flops_before) / rounds  # noqa: SLF001
    if mesh.size() == 1:  # the fused single-device step: every matrix here
        flops_ours = sum(polar_flops(*s) for s in SHAPES)
    holders = [math.prod(mesh.size(d) for d, pl in enumerate(p.placements) if not pl.is_replicate()) for p in ours]
    result = {
        "rank": rank,
        "seconds_per_step": {name: statistics.median(v) for name, v in samples.items()},
        "bytes_sent_per_step": {"ours": bytes_ours,
                                "naive": sum(p.to_local().numel() * 4 * (k - 1) for p, k in zip(ours, holders))},
        "polar_flops": {"ours": flops_ours, "naive": sum(polar_flops(*s) for s in SHAPES)},
        "same_params": same,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--layout", default="fsdp", choices=["fsdp", "tp", "fsdp_tp"])
    parser.add_argument("--out", default="bench/results/distributed.json")
    args = parser.parse_args()
    results = {"environment": environment(torch.device(args.device)), "shapes": SHAPES, "layout": args.layout,
               "runs": {}}
    tmp = args.out + ".part"
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda":  # NCCL: one GPU per rank
        skipped = [w for w in worlds if w > torch.cuda.device_count()]
        if skipped:
            print(f"skipping W={skipped}: {torch.cuda.device_count()} GPU(s) here", flush=True)
            results["skipped_worlds"] = skipped
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    for world in worlds:
        mp.spawn(_worker, args=(world, 29600 + world, args.device, tmp, args.layout), nprocs=world)
        ranks = torch.load(tmp)
        os.remove(tmp)
        step = {name: max(r["seconds_per_step"][name] for r in ranks) for name in ("ours", "naive")}
        results["runs"][f"W{world}"] = {
            "seconds_per_step": step,
            "naive_over_ours": step["naive"] / step["ours"],
            "bytes_sent_per_rank_per_step": {name: max(r["bytes_sent_per_step"][name] for r in ranks)
                                             for name in ("ours", "naive")},
            "muon_param_bytes": sum(r * c * 4 for r, c in SHAPES),
            "polar_flops_per_rank": {name: max(r["polar_flops"][name] for r in ranks) for name in ("ours", "naive")},
            "same_params": all(r["same_params"] for r in ranks),
        }
    write_json(args.out, results)


if __name__ == "__main__":
    sys.exit(main())
