"""Benchmark: muon_ext's multi-tensor AdamW against torch.optim.AdamW (fused, foreach).

All contenders update the same GPT-like parameter list in one process. Reports
seconds per step, params/s, the ratio to torch's fused AdamW on FP32 params,
and the bytes moved per second against a plain copy_ measured in the same
interleaved rounds (CPU and GPU). Usage: python bench/adamw.py [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse

import torch

from common import environment, gpt_shapes, numel, time_interleaved, write_json
from muon_ext import ops

# Bytes moved per element by each contender (reads + writes).
BYTES_FP32 = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v
BYTES_REMAINDER = {torch.float32: 2 + 2 + 4 + 4 + 4 + 2 + 2 + 4 + 4, torch.bfloat16: 2 + 2 + 2 + 4 + 4 + 2 + 2 + 4 + 4}


def param_sets(device):
    if device.type == "cuda":
        return {
            "gpt124m": gpt_shapes(768, 12, 50304)["hidden"] + gpt_shapes(768, 12, 50304)["other"],
            "gpt1.3b": gpt_shapes(2048, 24, 50304)["hidden"] + gpt_shapes(2048, 24, 50304)["other"],
            "many_small_4k": [(4096,)] * 2000,
        }
    return {
        "gpt_d256_l4": gpt_shapes(256, 4, 8192)["hidden"] + gpt_shapes(256, 4, 8192)["other"],
        "many_small_4k": [(4096,)] * 500,
    }


def torch_step(shapes, device, **flags):
    """One torch.optim.AdamW step over fresh params (fused / foreach by flags)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags).step


def our_step(shapes, device, mode, grad_dtype=torch.float32):
    """One ops.adamw_step over fresh params: FP32 params, or BF16 + int16 remainders."""
    gen = torch.Generator(device=device).manual_seed(0)
    masters = [torch.randn(s, device=device, generator=gen) for s in shapes]
    if mode == "fp32":
        params, extra = masters, []
    else:  # bf16 + int16 remainder
        params = [m.bfloat16() for m in masters]
        extra = [torch.zeros(s, dtype=torch.int16, device=device) for s in shapes]
    grads = [torch.randn(s, device=device, generator=gen).to(grad_dtype) for s in shapes]
    exp_avgs = [torch.zeros(s, device=device) for s in shapes]
    exp_avg_sqs = [torch.zeros(s, device=device) for s in shapes]
    steps = [torch.zeros((), device=device) for _ in shapes]
    lr = torch.tensor([1e-3], device=device) if device.type == "cuda" else 1e-3

    def step():
        ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, masters=extra, lr=lr, weight_decay=0.01)

    return step


def plain_copy(device):
    """A copy_ of 1 GiB (GPU) or 256 MiB (CPU) and the bytes it moves (read + write)."""
    nbytes = 2**30 if device.type == "cuda" else 2**28
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results/adamw.json")
    args = parser.parse_args()
    device = torch.device(args.device)

    results = {"benchmark": "adamw", "environment": environment(device), "cases": []}
    copy, copy_bytes = plain_copy(device)
    for name, shapes in param_sets(device).items():
        n = numel(shapes)
        seconds = time_interleaved({
            "plain_copy": copy,  # the bandwidth reference, in the same rounds
            "torch_fused": torch_step(shapes, device, fused=True),
            "torch_foreach": torch_step(shapes, device, foreach=True),
            "ours_fp32": our_step(shapes, device, "fp32"),
            "ours_bf16_remainder": our_step(shapes, device, "bf16_remainder"),
            "ours_bf16_remainder_bf16_grads": our_step(shapes, device, "bf16_remainder", torch.bfloat16),
        }, device)
        t_fused, t_foreach, t_ours = seconds["torch_fused"], seconds["torch_foreach"], seconds["ours_fp32"]
        t_rem, t_rem_bf16g = seconds["ours_bf16_remainder"], seconds["ours_bf16_remainder_bf16_grads"]
        case = {
            "params": name, "numel": n, "tensors": len(shapes),
            "seconds": seconds,
            "params_per_s": {"torch_fused": n / t_fused, "ours_fp32": n / t_ours,
                             "ours_bf16_remainder": n / t_rem},
            "speedup_vs_torch_fused": {"ours_fp32": t_fused / t_ours, "ours_bf16_remainder": t_fused / t_rem},
            "speedup_vs_torch_foreach": {"ours_fp32": t_foreach / t_ours},
        }
        copy_bw = copy_bytes / seconds["plain_copy"]
        case["copy_bytes_per_s"] = copy_bw
        bw = {"ours_fp32": n * BYTES_FP32 / t_ours, "torch_fused": n * BYTES_FP32 / t_fused,
              "ours_bf16_remainder": n * BYTES_REMAINDER[torch.float32] / t_rem,
              "ours_bf16_remainder_bf16_grads": n * BYTES_REMAINDER[torch.bfloat16] / t_rem_bf16g}
        case["bytes_per_s"] = bw
        case["fraction_of_copy_bandwidth"] = {k: v / copy_bw for k, v in bw.items()}
        case["targets"] = targets(name, case, device)
        results["cases"].append(case)
    write_json(args.out, results)


def targets(name, case, device):
    """The issue's performance targets, evaluated on this run."""
    speedup = case["speedup_vs_torch_fused"]["ours_fp32"]
    if device.type != "cuda":
        return {"cpu_at_least_torch_fused": speedup >= 1.0}
    if name.startswith("many_small"):
        return {"at_least_1.1x_torch_fused_launch_bound": speedup >= 1.1}
    return {"at_least_torch_fused": speedup >= 1.0,
            "at_least_85pct_copy_bandwidth": case["fraction_of_copy_bandwidth"]["ours_fp32"] >= 0.85}


if __name__ == "__main__":
    main()
