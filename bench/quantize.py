"""Benchmark: quantize_fp8 (muon_ext.quantized) over every matrix of a GPT-like model.

Quantizes each 2-D param (FP32 master) into preallocated FP8 + scale buffers,
with 128x128 blocks and with one scale per tensor. On GPU (GPT 1.3B-like set)
it reports bytes moved per second (4 read + 1 written per element) against a
device-to-device copy measured in the same run (target >= 70%); on CPU (a
scaled-down set, under a minute) the speedup over the plain-PyTorch reference
(muon_ext.reference.quantize_fp8; target >= 3x).
Usage: python bench/quantize.py [--device cuda] [--out results.json]
(on a busy CPU host, OMP_NUM_THREADS=1 gives steadier figures for both contenders)
"""

from __future__ import annotations

import argparse

import torch

from adamw import copy_bandwidth
from common import environment, gpt_shapes, numel, time_interleaved, write_json
from muon_ext import quantized, reference

BYTES_PER_ELEMENT = 4 + 1  # read the FP32 master, write the FP8 value (scales: negligible)


def matrices(device):
    shapes = gpt_shapes(2048, 24, 50304) if device.type == "cuda" else gpt_shapes(256, 4, 8192)
    return [s for s in shapes["hidden"] + shapes["other"] if len(s) == 2]


def fp32_masters(shapes, device):
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(s, device=device, generator=gen) for s in shapes]


def ours(shapes, device, block):
    masters = fp32_masters(shapes, device)
    outs = [quantized.quantize_fp8(m, block=block) for m in masters]

    def run():
        for m, (q, scale_inv) in zip(masters, outs):
            quantized.quantize_fp8(m, block=block, out=q, out_scale_inv=scale_inv)

    return run


def plain_torch(shapes, device, block):
    masters = fp32_masters(shapes, device)
    return lambda: [reference.quantize_fp8(m, block) for m in masters]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results/quantize.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = matrices(device)
    n = numel(shapes)

    results = {"benchmark": "quantize_fp8", "environment": environment(device), "numel": n, "tensors": len(shapes),
               "cases": []}
    copy_bw = copy_bandwidth(device) if device.type == "cuda" else None
    if copy_bw:
        results["copy_bytes_per_s"] = copy_bw
    for name, block in (("block_128x128", (128, 128)), ("per_tensor", None)):
        contenders = {"ours": ours(shapes, device, block), "reference": plain_torch(shapes, device, block)}
        seconds = time_interleaved(contenders, device, rounds=3, iters=3)
        bytes_per_s = n * BYTES_PER_ELEMENT / seconds["ours"]
        case = {"case": name, "seconds": seconds, "bytes_per_s": bytes_per_s,
                "speedup_vs_reference": seconds["reference"] / seconds["ours"]}
        if copy_bw:
            case["fraction_of_copy_bandwidth"] = bytes_per_s / copy_bw
            case["targets"] = {"at_least_70pct_copy_bandwidth": case["fraction_of_copy_bandwidth"] >= 0.7}
        else:
            case["targets"] = {"at_least_3x_reference": case["speedup_vs_reference"] >= 3.0}
        results["cases"].append(case)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
