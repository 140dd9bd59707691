"""Benchmark: MuonAdamW(offload="cpu") against the resident optimizer
(offload="none", FP32 masters: the same math) on a GPT-like parameter set.

Reports seconds per step (median, interleaved rounds) and their ratio, the
optimizer's device memory (state on the device between steps, and the peak a
step allocates above params and grads), and on GPU the H2D / D2H bandwidth of
the staged copies against a plain pinned-memory copy measured in the same run.
Sets: a 1.3B-like GPT on GPU, a small one on CPU (runs in well under a minute).
Usage: python bench/offload.py [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import gc

import torch

from common import environment, gpt_shapes, numel, time_interleaved, write_json
from muon_ext import MuonAdamW, OffloadConfig

MUON_LR, ADAMW_LR, WD = 0.02, 3e-4, 0.1


def param_set(device):
    if device.type == "cuda":
        return "gpt1.3b_d2048_l24", gpt_shapes(2048, 24, 50304)
    return "gpt_d128_l2_v4096", gpt_shapes(128, 2, 4096, seq=256)


def build(shapes, device, offload):
    gen = torch.Generator(device=device).manual_seed(0)

    def make(sizes):
        params = []
        for s in sizes:
            p = torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).bfloat16())
            p.grad = torch.randn(s, device=device, generator=gen).bfloat16()
            params.append(p)
        return params

    groups = [{"params": make(shapes["hidden"]), "kind": "muon", "lr": MUON_LR, "weight_decay": WD},
              {"params": make(shapes["other"]), "kind": "adamw", "lr": ADAMW_LR, "weight_decay": WD}]
    kwargs = dict(offload="cpu", offload_config=OffloadConfig(buffer_count=2)) if offload else dict(
        store_param_remainders=False)
    return MuonAdamW(groups, **kwargs)


def state_bytes_on(opt, device) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.device.type == device.type)


def step_and_drain(opt):
    opt.step()
    opt.drain()


def pinned_bandwidth(nbytes: int) -> dict:
    """GB/s of one plain pinned <-> device copy of `nbytes` (median of 5)."""
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    out = {}
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        seconds = time_interleaved({name: fn}, torch.device("cuda"), rounds=1, iters=5)[name]
        out[name] = nbytes / seconds / 1e9
    return out


def staged_bandwidth(opt) -> dict:
    """GB/s of the staged Muon state copies: each step moves every Muon param's
    slab region H2D and back D2H; timed as the whole step's copy streams."""
    streams = opt._runner.streams
    nbytes = sum(layout.size * 4 for layout in opt._runner.layouts.values() if layout.info.kind == "muon")
    out = {}
    for name, stream in (("h2d", streams.h2d), ("d2h", streams.d2h)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        stream.record_event(start)
        opt.step()
        stream.record_event(end)
        opt.drain()
        # The span includes waits on compute: a lower bound on the copy engine's rate.
        out[name] = nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="bench_offload.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    name, shapes = param_set(device)
    results = {"set": name, "params": numel(shapes["hidden"]) + numel(shapes["other"]),
               "muon_params": numel(shapes["hidden"]), "environment": environment(device)}
    opts = {}
    for mode in ("resident", "offload"):
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        opts[mode] = opt = build(shapes, device, mode == "offload")
        step_and_drain(opt)  # state, slots and workspaces made
        entry = {"state_bytes_on_device": state_bytes_on(opt, device) if device.type == "cuda" else None,
                 "state_bytes_on_cpu": state_bytes_on(opt, torch.device("cpu"))}
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step_and_drain(opt)
            entry["device_bytes_held_by_optimizer"] = base - before - sum(
                2 * p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])  # params + grads
            entry["step_peak_bytes_above_held"] = torch.cuda.max_memory_allocated() - base
        results[mode] = entry
    times = time_interleaved({mode: (lambda o=opt: step_and_drain(o)) for mode, opt in opts.items()}, device,
                             rounds=3, iters=3)
    for mode, seconds in times.items():
        results[mode]["seconds_per_step"] = seconds
    results["offload_over_resident_time"] = times["offload"] / times["resident"]
    if device.type == "cuda":
        nbytes = sum(layout.size * 4 for layout in opts["offload"]._runner.layouts.values())
        results["pinned_copy_gb_per_s"] = pinned_bandwidth(min(nbytes, 1 << 30))
        results["staged_copy_gb_per_s"] = staged_bandwidth(opts["offload"])
    del opts
    gc.collect()
    write_json(args.out, results)


if __name__ == "__main__":
    main()
