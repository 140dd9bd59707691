"""Benchmark: muon_ext's Muon step against the seed's MuonAdamW and torch.optim.Muon.

Every contender updates the same stack of same-shape matrices in one process,
in interleaved rounds (one step of every contender in turn, after each one's own
warm-up steps), so a change in host load between contenders hits them alike.
Reports seconds per step (median over the rounds, with min and max) and ratios
of medians; on GPU also the Polar-Express FLOP rate against a plain batched
BF16 GEMM measured in the same run, and `fraction_of_same_gemms`: the step's
time against its Polar-Express GEMMs alone on the same shapes (torch.bmm /
baddbmm, interleaved as a contender), which tells cuBLAS's own rate on small
shapes apart from the time the rest of the step takes.
Usage: python bench/muon.py [--device cuda] [--out results.json] [--avx2-host] [--rounds N]

On the CPU, compare `environment.gemm_flops_per_s`: torch.optim.Muon and the seed
orthogonalize with BF16 matmuls, ours with FP32 ones, so the ratio depends on
whether the CPU has a fast BF16 GEMM (oneDNN on AVX-512 BF16/AMX) or not.
`--avx2-host` reruns the benchmark with the libraries capped at AVX2, which
reproduces a CPU without one. Per-shape fractions of the host's own GEMM rate
(interleaved against a torch.bmm probe of the same GEMMs, 1 and 2 threads, and
small-matrix stacks): bench/polar_rate.py.
"""

from __future__ import annotations

import argparse

import torch

from common import (environment, gpt_shapes, interleaved_samples, reexec_as_avx2_host, spread, time_fn, with_env,
                    write_json)
from muon_ext import ops
from peers import load_seed


def stacks(device):
    if device.type == "cuda":
        return {"16x1024x1024": [(1024, 1024)] * 16, "24x1024x4096": [(1024, 4096)] * 24,
                "8x4096x4096": [(4096, 4096)] * 8}
    return {"gpt_d256_l4_hidden": gpt_shapes(256, 4, 8192)["hidden"]}


def polar_express_flops(shapes, ns_steps=5):
    total = 0
    for rows, cols in shapes:
        s, l = min(rows, cols), max(rows, cols)
        total += ns_steps * (4 * s * s * l + 2 * s * s * s)  # X X^T, A A, B X
    return total


def by_shape(shapes):
    groups = {}
    for s in shapes:
        groups.setdefault(s, []).append(s)
    return list(groups.values())


def ours_step(shapes, device, mode, row_blocks=None, polar_method="standard"):
    """One ops.muon_step per same-shape bucket over fresh params (FP32, or BF16 + int16 remainders)."""
    buckets = []
    gen = torch.Generator(device=device).manual_seed(0)
    for group in by_shape(shapes):
        rows, cols = group[0]
        stat = (rows, 1) if rows >= cols else (1, cols)
        masters = [torch.randn(s, device=device, generator=gen) * 0.02 for s in group]
        params = masters if mode == "fp32" else [m.bfloat16() for m in masters]
        extra = [] if mode == "fp32" else [torch.zeros(s, dtype=torch.int16, device=device) for s in group]
        grads = [torch.randn(s, device=device, generator=gen).to(params[0].dtype) for s in group]
        moms = [torch.zeros(s, device=device) for s in group]
        smbs = [torch.zeros(stat, device=device) for _ in group]
        buckets.append((params, grads, moms, smbs, extra))
    lr = torch.tensor([0.02], device=device) if device.type == "cuda" else 0.02

    def step():
        for params, grads, moms, smbs, extra in buckets:
            ops.muon_step(params, grads, moms, smbs, masters=extra, lr=lr, polar_row_blocks=row_blocks,
                          polar_method=polar_method)

    return step


def make_params(shapes, device, dtype=torch.float32):
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen, dtype=dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen, dtype=dtype)
    return params


def seed_step(shapes, device, compiled):
    """The seed's MuonAdamW step, one Muon group per shape; None where ../shared is absent."""
    module = load_seed(compiled)
    if module is None:
        return None
    groups = [{"params": make_params(g, device), "kind": "muon", "lr": 0.02, "momentum": 0.95,
               "weight_decay": 0.1, "beta2": 0.95, "ns_steps": 5} for g in by_shape(shapes)]
    return module.MuonAdamW(groups).step


def torch_muon_step(shapes, device):
    """torch.optim.Muon's step; None where this torch has none."""
    if not hasattr(torch.optim, "Muon"):
        return None
    return torch.optim.Muon(make_params(shapes, device), lr=0.02, weight_decay=0.1).step


def same_gemms_step(shapes, device, ns_steps=5):
    """CUDA: the GEMMs of our BF16 Polar-Express alone, per same-shape bucket:
    torch.bmm / baddbmm on the same shapes (X X^T, c A A + b A, B X + a X per
    iteration, the coefficients in the GEMMs' epilogues as cuBLAS runs them).
    This shape's own GEMM rate: a step slower than it is slowed by the rest."""
    buckets = []
    gen = torch.Generator(device=device).manual_seed(0)
    for group in by_shape(shapes):
        rows, cols = group[0]
        s, l = min(rows, cols), max(rows, cols)
        x = torch.randn(len(group), s, l, device=device, generator=gen)
        x = (x / x.flatten(1).norm(dim=1).view(-1, 1, 1)).bfloat16()
        gram = torch.empty(len(group), s, s, device=device, dtype=torch.bfloat16)
        buckets.append((x, torch.empty_like(x), gram, torch.empty_like(gram)))
    a, b, c = 3.4445, -4.7750, 2.0315  # a quintic Newton-Schulz step: values stay bounded

    def step():
        for x, out, gram, poly in buckets:
            src, dst = x, out
            for _ in range(ns_steps):
                torch.bmm(src, src.transpose(1, 2), out=gram)
                torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
                torch.baddbmm(src, poly, src, beta=a, out=dst)
                src, dst = dst, src

    return step


def gemm_rate(device, b=8, n=4096):
    x = torch.randn(b, n, n, device=device, dtype=torch.bfloat16)
    seconds = time_fn(lambda: torch.bmm(x, x), device, warmup=3, iters=10)
    return 2 * b * n**3 / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results/muon.json")
    parser.add_argument("--skip-compiled-seed", action="store_true", help="skip torch.compile of the seed (slow on CPU)")
    parser.add_argument("--avx2-host", action="store_true",
                        help="CPU only: cap oneDNN/MKL/ATen at AVX2 (no fast BF16 GEMM), see the module doc")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (one sample per contender each)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="CPU: time by the process's CPU time, not wall time (robust to a loaded host at --threads 1)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.avx2_host:
        reexec_as_avx2_host()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    compile_seed = device.type == "cuda" and not args.skip_compiled_seed

    clock = "process" if args.cpu_time and device.type == "cpu" else "wall"
    results = {"benchmark": "muon", "environment": environment(device), "clock": clock, "cases": [],
               "notes": [] if load_seed(False) is not None else ["../shared absent: seed peer skipped"]}
    if device.type == "cuda":
        results["bf16_bmm_flops_per_s"] = gemm_rate(device)
    errors = results.setdefault("errors", {})

    def guarded(key, build):
        """A contender's step function, or None (its error recorded and printed) where it can't be built."""
        try:
            return build()
        except Exception as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
            print(f"  {key}: {errors[key]}", flush=True)
            return None

    for name, shapes in stacks(device).items():
        builders = {"ours_fp32": lambda: ours_step(shapes, device, "fp32"),
                    "ours_bf16_remainder": lambda: ours_step(shapes, device, "bf16_remainder"),
                    "seed_eager": lambda: seed_step(shapes, device, compiled=False),
                    "seed_compiled": (lambda: seed_step(shapes, device, compiled=True)) if compile_seed else None,
                    "torch_muon": lambda: torch_muon_step(shapes, device)}
        # Block-triangular X X^T and A A (polar_row_blocks): plain GEMMs on the CPU
        # for comparison with its default, block counts to choose from on GPU.
        for blocks in ((2, 4, 8) if device.type == "cuda" else (1,)):
            builders[f"ours_bf16_remainder_row_blocks_{blocks}"] = (
                lambda blocks=blocks: ours_step(shapes, device, "bf16_remainder", blocks))
        if device.type == "cpu":  # Gram Newton-Schulz on every matrix (not the default; docs/design.md)
            builders["ours_bf16_remainder_gram"] = lambda: ours_step(shapes, device, "bf16_remainder",
                                                                     polar_method="gram")
        if device.type == "cuda":  # the CPU's per-shape probe is bench/polar_rate.py
            builders["same_gemms_bf16"] = lambda: same_gemms_step(shapes, device)
            # Every Polar-Express copy run, none folded into cublasLt GEMMs (docs/design.md, "CUDA kernels").
            builders["ours_bf16_remainder_copies"] = lambda: with_env(
                ours_step(shapes, device, "bf16_remainder"), MUON_EXT_CUDA_POLAR_FOLD="0")
        steps = {key: guarded(f"{name}/{key}", build) if build is not None else None for key, build in builders.items()}
        # Each contender keeps its own params and state; warm-up steps first (the
        # seed's compilation, the thread pool, lazily made state), then `rounds`
        # rounds of one timed step of each in turn.
        step_errors = {}
        samples = interleaved_samples({k: fn for k, fn in steps.items() if fn is not None}, device,
                                      rounds=args.rounds, iters=1 if device.type == "cpu" else 5,
                                      warmup=3, round_warmup=0 if device.type == "cpu" else 1, errors=step_errors,
                                      clock=clock)
        errors.update({f"{name}/{k}": v for k, v in step_errors.items()})
        seconds = {k: spread(samples[k])["median"] if samples.get(k) else None for k in steps}
        spreads = {k: spread(v) for k, v in samples.items() if v}
        print_stack(name, spreads)
        if seconds["ours_fp32"] is None or seconds["ours_bf16_remainder"] is None:
            results["cases"].append({"stack": name, "matrices": len(shapes), "seconds": seconds,
                                     "seconds_spread": spreads})
            write_json(args.out, results)
            continue
        case = {"stack": name, "matrices": len(shapes), "seconds": seconds, "seconds_spread": spreads,
                "speedup": {f"ours_fp32_vs_{k}": v / seconds["ours_fp32"]
                            for k, v in seconds.items() if v is not None and not k.startswith("ours")}}
        case["speedup"].update({f"ours_bf16_remainder_vs_{k}": v / seconds["ours_bf16_remainder"]
                                for k, v in seconds.items()
                                if v is not None and ("row_blocks" in k or "copies" in k or not k.startswith("ours"))})
        if seconds.get("ours_bf16_remainder_gram") and seconds.get("torch_muon"):
            case["speedup"]["ours_bf16_remainder_gram_vs_torch_muon"] = (
                seconds["torch_muon"] / seconds["ours_bf16_remainder_gram"])
        flops = polar_express_flops(shapes)
        case["polar_express_flops_per_s"] = {k: flops / v for k, v in seconds.items() if v is not None}
        achieved = flops / seconds["ours_bf16_remainder"]
        if device.type == "cuda":
            case["fraction_of_bf16_gemm_rate"] = achieved / results["bf16_bmm_flops_per_s"]
            if seconds.get("same_gemms_bf16"):
                # Our whole step against its GEMMs alone on the same shapes: 1 would be GEMM-bound.
                case["fraction_of_same_gemms"] = seconds["same_gemms_bf16"] / seconds["ours_bf16_remainder"]
        else:
            # On the CPU the BF16 path runs oneDNN BF16 GEMMs only where the CPU has
            # them (muon_ext.ops.cpu_bf16_gemm() == "native"), else FP32 GEMMs.
            rates = results["environment"].get("gemm_flops_per_s", {})
            case["fraction_of_gemm_rate"] = {dtype: achieved / rate for dtype, rate in rates.items() if rate}
        results["cases"].append(case)
        write_json(args.out, results)  # after every stack: a stage cut short still reports what it measured
    write_json(args.out, results)
    for case in results["cases"]:  # the summary after the JSON, where a terminal shows it
        print_stack(case["stack"], case["seconds_spread"], case.get("speedup", {}))


def print_stack(name, spreads, speedup=None):
    """One line per contender: median ms per step and the min..max over the rounds; then the ratios."""
    print(f"{name}:", flush=True)
    for k, s in spreads.items():
        print(f"  {k:40s} {s['median'] * 1e3:9.2f} ms  ({s['min'] * 1e3:.2f}..{s['max'] * 1e3:.2f}, "
              f"{s['samples']} rounds)", flush=True)
    for k, v in (speedup or {}).items():
        print(f"  {k}: {v:.2f}x", flush=True)


if __name__ == "__main__":
    main()
