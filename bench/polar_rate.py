"""Benchmark: CPU Polar-Express against the host's own GEMM rate, per shape.

For every stack of same-shape matrices and thread count, the contenders run
interleaved in one process (rounds of: ours with polar_dtype "bfloat16", ours
with "float32", and a plain torch.bmm probe doing the same GEMMs: X X^T, A A
and B X per iteration, FP32, torch's own threading; and the same probe in BF16
where the CPU has a BF16 GEMM). Reported per contender:
median wall seconds with min..max over all samples, and process CPU seconds
(robust on a shared host at 1 thread: time spent descheduled is not counted).
`fraction` = probe seconds / ours seconds, i.e. our Polar-Express rate as a
fraction of the measured GEMM rate of the path in use on the same plain-GEMM
FLOP count: the FP32 probe for "float32"; for "bfloat16" a BF16 probe
(`gemm_probe_bfloat16`) where ops.cpu_bf16_gemm() is "native".

Where ops.cpu_bf16_gemm() is "rounded" (no BF16 GEMM in the CPU), the
"bfloat16" path runs FP32 GEMMs on BF16-rounded operands, so FP32 is its limit.

`--methods` (stacks "gram"): Gram Newton-Schulz against the standard
iteration, interleaved the same way per shape and polar_dtype
("float32", "bfloat16" and "float16"; the 16-bit ones "rounded" on a CPU
without a BF16 / FP16 GEMM):
median and min..max seconds of each, and `gram_speedup` = standard / gram
median (>1: Gram is faster); the figures behind polar_method="auto"'s rule.

Where ops.cpu_bf16_tile_gemm() (AMX or AVX-512 BF16: the native path on
oneDNN's micro-kernel) and both sides are multiples of 16, `ours_bfloat16_addmm` is the same path
with the tiles off (MUON_EXT_CPU_TILE_GEMM=0: at::addmm_out), interleaved
with the rest, against the same BF16 probe.

Small-matrix stacks (many tiny matrices in one batch-view param) report a full
muon_step (BF16 params + remainders, NorMuon) in microseconds per matrix and
against `state_copy`: one copy_ of every state tensor the step reads or writes
(bytes in `small_case`). Issue #24's small-matrix figures, one command:
    python bench/polar_rate.py --stacks 8192x8x8,70000x8x8,70000x1x1 --threads 1,2

Usage: python bench/polar_rate.py [--threads 1,2] [--rounds 5] [--stacks gpt,4x1024x4096,small,gram]
       [--gram-shapes 1024x4096,4096x1024,256x1024,1024x256,512x1024,128x1024,1024x1024]
       [--gram-dtypes float32,bfloat16,float16]
       [--out bench/results/polar_rate.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from common import environment, gpt_shapes
from muon_ext import ops


def polar_stacks() -> Dict[str, List[tuple]]:
    stacks = {}
    for shape in gpt_shapes(256, 4, 8192)["hidden"]:
        stacks.setdefault(f"gpt_d256_{shape[0]}x{shape[1]}", []).append(shape)
    stacks["4x1024x4096"] = [(1024, 4096)] * 4
    return stacks


SMALL_STACKS = {"8192x8x8": (8192, 8, 8), "70000x1x1": (70000, 1, 1), "70000x8x8": (70000, 8, 8),
                "1024x32x32": (1024, 32, 32), "256x64x64": (256, 64, 64)}


def sample(fn: Callable[[], None], iters: int) -> List[tuple]:
    """(wall, cpu) seconds of each of `iters` calls."""
    out = []
    for _ in range(iters):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        out.append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


def interleaved(fns: Dict[str, Callable[[], None]], rounds: int, iters: int) -> Dict[str, dict]:
    samples = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name] += sample(fn, iters)
    summary = {}
    for name, values in samples.items():
        wall = [w for w, _ in values]
        cpu = [c for _, c in values]
        summary[name] = {"wall_median": statistics.median(wall), "wall_min": min(wall), "wall_max": max(wall),
                         "cpu_median": statistics.median(cpu)}
    return summary


def polar_case(shapes: List[tuple], rounds: int, iters: int) -> dict:
    rows, cols = shapes[0]
    count = len(shapes)
    gen = torch.Generator().manual_seed(0)
    updates = torch.randn(count, rows, cols, generator=gen)
    work = updates.clone()

    def ours(polar_dtype, tiles=True):
        def run():
            work.copy_(updates)
            setting = os.environ.get("MUON_EXT_CPU_TILE_GEMM")
            if not tiles:  # the at::addmm_out path the micro-kernel replaces (read at every call)
                os.environ["MUON_EXT_CPU_TILE_GEMM"] = "0"
            try:
                ops.muon_orthogonalize([work], beta2=None, polar_dtype=polar_dtype)
            finally:
                if setting is None:
                    os.environ.pop("MUON_EXT_CPU_TILE_GEMM", None)
                else:
                    os.environ["MUON_EXT_CPU_TILE_GEMM"] = setting
        return run

    side, length = min(rows, cols), max(rows, cols)

    def gemm_probe(dtype):
        x = (torch.randn(count, side, length, generator=gen) / (side * length) ** 0.5).to(dtype)
        gram = torch.empty(count, side, side, dtype=dtype)
        poly = torch.empty(count, side, side, dtype=dtype)
        out = torch.empty(count, side, length, dtype=dtype)

        def probe():
            out.copy_(updates.view(count, side, length))  # the same copy-in as ours
            for _ in range(5):
                torch.bmm(x, x.mT, out=gram)
                torch.bmm(gram, gram, out=poly)
                torch.bmm(poly, x, out=out)
        return probe

    # The yardstick of each path: "bfloat16" runs BF16 GEMMs where the CPU has
    # them ("native"), else FP32 GEMMs of BF16-rounded values.
    native = ops.cpu_bf16_gemm() == "native"
    contenders = {"ours_bfloat16": ours("bfloat16"), "ours_float32": ours("float32"),
                  "gemm_probe": gemm_probe(torch.float32)}
    if native:
        contenders["gemm_probe_bfloat16"] = gemm_probe(torch.bfloat16)
    tiles = ops.cpu_bf16_tile_gemm() and side % 16 == 0 and length % 16 == 0
    if tiles:
        contenders["ours_bfloat16_addmm"] = ours("bfloat16", tiles=False)
    times = interleaved(contenders, rounds, iters)
    flops = 5 * count * (4 * side * side * length + 2 * side ** 3)
    yardstick = {"ours_float32": "gemm_probe", "ours_bfloat16": "gemm_probe_bfloat16" if native else "gemm_probe"}
    if tiles:
        yardstick["ours_bfloat16_addmm"] = "gemm_probe_bfloat16"
    return {"shape": [rows, cols], "matrices": count, "flops": flops, "seconds": times,
            "gemm_probe_flops_per_s": {k: flops / times[k]["wall_median"] for k in times if k.startswith("gemm_probe")},
            "fraction_against": yardstick,
            "fraction": {k: times[p]["wall_median"] / times[k]["wall_median"] for k, p in yardstick.items()},
            "fraction_cpu_time": {k: times[p]["cpu_median"] / times[k]["cpu_median"] for k, p in yardstick.items()}}


def gram_case(shape: tuple, rounds: int, iters: int, dtypes=("float32", "bfloat16", "float16")) -> dict:
    """Standard vs Gram Newton-Schulz on one matrix, per polar_dtype, interleaved."""
    rows, cols = shape
    updates = torch.randn(1, rows, cols, generator=torch.Generator().manual_seed(0))
    work = updates.clone()

    def run(polar_dtype, polar_method):
        def fn():
            work.copy_(updates)
            ops.muon_orthogonalize([work], beta2=None, polar_dtype=polar_dtype, polar_method=polar_method)
        return fn

    contenders = {f"{m}_{d}": run(d, m) for d in dtypes for m in ("standard", "gram")}
    times = interleaved(contenders, rounds, iters)
    return {"shape": [rows, cols], "seconds": times,
            "gram_speedup": {d: times[f"standard_{d}"]["wall_median"] / times[f"gram_{d}"]["wall_median"]
                             for d in dtypes},
            "gram_speedup_cpu_time": {d: times[f"standard_{d}"]["cpu_median"] / times[f"gram_{d}"]["cpu_median"]
                                      for d in dtypes}}


def load_average() -> str:
    """`uptime`'s load averages (1, 5, 15 min): the host is shared; every figure states it."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "unknown"


def small_case(shape: tuple, rounds: int, iters: int) -> dict:
    """A full muon_step (BF16 params + int16 remainders, BF16 grads, NorMuon) on one
    [count, rows, cols] param, against `state_copy`, interleaved in one process.

    Bytes the step must move per element: grad read (2), momentum read + write
    (4 + 4), param read + write (2 + 2), remainder read + write (2 + 2) = 18,
    plus the NorMuon second moments (4 + 4 per row or column). `state_copy` is
    one torch copy_ of each of those tensors into a spare of its size: it reads
    and writes every one, the grad included (a write the step does not do), so
    it moves 20 bytes per element plus the second moments twice.
    `step_over_state_copy` is the ratio of median wall times;
    `step_over_state_copy_per_byte` divides each time by its bytes first (the
    step's bandwidth against the copy's)."""
    count, rows, cols = shape
    gen = torch.Generator().manual_seed(0)
    params = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
    remainders = torch.zeros(shape, dtype=torch.int16)
    grads = torch.randn(shape, generator=gen).bfloat16()
    moms = torch.zeros(shape)
    smbs = torch.zeros((count, rows, 1) if rows >= cols else (count, 1, cols))
    state = [params, remainders, grads, moms, smbs]
    copies = [torch.empty_like(t) for t in state]

    def step():
        ops.muon_step([params], [grads], [moms], [smbs], masters=[remainders], lr=0.02)

    def state_copy():
        for dst, src in zip(copies, state):
            dst.copy_(src)

    def nbytes(t):
        return t.numel() * t.element_size()

    step_bytes = nbytes(grads) + 2 * (nbytes(moms) + nbytes(params) + nbytes(remainders) + nbytes(smbs))
    copy_bytes = 2 * sum(nbytes(t) for t in state)
    load_before = load_average()
    times = interleaved({"muon_step": step, "state_copy": state_copy}, rounds, iters)
    step_t, copy_t = times["muon_step"]["wall_median"], times["state_copy"]["wall_median"]
    return {"shape": list(shape), "seconds": times, "us_per_matrix": step_t / count * 1e6,
            "step_bytes": step_bytes, "copy_bytes": copy_bytes,
            "step_over_state_copy": step_t / copy_t,
            "step_over_state_copy_per_byte": (step_t / step_bytes) / (copy_t / copy_bytes),
            "copy_bytes_per_s": copy_bytes / copy_t,
            "step_over_state_copy_cpu_time": times["muon_step"]["cpu_median"] / times["state_copy"]["cpu_median"],
            "load_before": load_before, "load_after": load_average()}


def save(path: str, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stacks", default="gpt,4x1024x4096,small")
    parser.add_argument("--gram-shapes", default="1024x4096,4096x1024,256x1024,1024x256,512x1024,128x1024,1024x1024")
    parser.add_argument("--gram-dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--out", default="bench/results/polar_rate.json")
    args = parser.parse_args()
    wanted = set(args.stacks.split(","))
    results = {"benchmark": "polar_rate", "environment": environment(torch.device("cpu")),
               "cpu_bf16_gemm": ops.cpu_bf16_gemm(), "cpu_bf16_tile_gemm": ops.cpu_bf16_tile_gemm(),
               "cases": []}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        if "gram" in wanted:
            for spec in args.gram_shapes.split(","):
                shape = tuple(int(v) for v in spec.split("x"))
                load_before = load_average()
                case = {"stack": f"gram_{spec}", "threads": threads, **gram_case(shape, args.rounds, 1, tuple(args.gram_dtypes.split(","))),
                        "load_before": load_before, "load_after": load_average()}
                results["cases"].append(case)
                spread = {k: f"{v['wall_median']:.4f} [{v['wall_min']:.4f}..{v['wall_max']:.4f}]"
                          for k, v in case["seconds"].items()}
                print(f"{threads} thr gram {spec}: speedup {case['gram_speedup']} cpu-time "
                      f"{case['gram_speedup_cpu_time']} seconds {spread} load {load_before} -> {case['load_after']}",
                      flush=True)
                save(args.out, results)
        for name, shapes in polar_stacks().items():
            if ("gpt" in wanted and name.startswith("gpt")) or name in wanted:
                iters = 1 if shapes[0][0] * shapes[0][1] >= 1 << 22 else 3
                case = {"stack": name, "threads": threads, **polar_case(shapes, args.rounds, iters)}
                results["cases"].append(case)
                print(f"{threads} thr {name}: fraction {case['fraction']} cpu-time {case['fraction_cpu_time']} "
                      f"against {case['fraction_against']}", flush=True)
                save(args.out, results)
        for name, shape in SMALL_STACKS.items():
            if "small" in wanted or name in wanted:
                case = {"stack": name, "threads": threads, **small_case(shape, args.rounds, 3)}
                results["cases"].append(case)
                print(f"{threads} thr {name}: {case['us_per_matrix']:.3f} us/matrix, "
                      f"{case['step_over_state_copy']:.2f}x state copy "
                      f"({case['step_over_state_copy_per_byte']:.2f}x per byte; copy "
                      f"{case['copy_bytes_per_s'] / 1e9:.1f} GB/s; cpu-time {case['step_over_state_copy_cpu_time']:.2f}x) "
                      f"load {case['load_before']} -> {case['load_after']}", flush=True)
                save(args.out, results)


if __name__ == "__main__":
    main()
