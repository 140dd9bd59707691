"""Benchmark: the full MuonAdamW step (Muon for hidden matrices, AdamW for the
rest) on GPT-like parameter sets, against peers in the same process:

* ours: muon_ext.MuonAdamW on BF16 params with int16 remainders (exact FP32
  masters), and on FP32 params; and the BF16 one with `torch.compile(opt.step)`
  (eager vs compiled step time);
* the seed's MuonAdamW (../shared/peers; torch.compile on GPU, eager on CPU),
  one Muon group per shape as it requires, on FP32 params (its state takes the
  param dtype, so FP32 params are what gives it FP32 masters) and BF16 params;
* torch.optim.Muon + torch.optim.AdamW(fused=True) as a pair, on FP32 and BF16
  params.

Contenders are timed in interleaved rounds (one step of every contender in
turn, after each one's own warm-up steps; each keeps its own params and state),
so a change in host load between contenders hits them alike.  Reports seconds
per step (median over the rounds, with min and max), the speedup of ours
(BF16 + remainders) over each peer (ratio of medians), and persistent bytes per parameter counted from the actual
tensors (params + optimizer state; the seed and torch create state lazily, so
this is counted after the warmup steps). On GPU it also reports the memory a
step allocates on top of that (peak during a step) and memory held between
steps beyond params, grads and state (cached workspaces).
Usage: python bench/step.py [--device cuda] [--out results.json] [--avx2-host] [--rounds N]
  [--one-at-a-time]
(`--avx2-host`: see bench/muon.py. `--one-at-a-time`: build, time and free the
contenders one after the other, as before interleaving, for a device too small
to hold them all at once.)
"""

from __future__ import annotations

import argparse
import gc

import torch

from common import environment, gpt_shapes, interleaved_samples, numel, reexec_as_avx2_host, spread, write_json
from muon_ext import MuonAdamW
from peers import load_seed

MUON_LR, ADAMW_LR, WD = 0.02, 3e-4, 0.1


def param_sets(device):
    if device.type == "cuda":
        return {"gpt124m_d768_l12": gpt_shapes(768, 12, 50304), "gpt1.3b_d2048_l24": gpt_shapes(2048, 24, 50304)}
    return {"gpt_d256_l4_v8192": gpt_shapes(256, 4, 8192)}


def make_params(shapes, device, dtype, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.02).to(dtype))
        p.grad = torch.randn(s, device=device, generator=gen).to(dtype)
        params.append(p)
    return params


def build_ours(sets, device, dtype, compiled=False, polar_dtype="bfloat16", polar_method="standard"):
    hidden, other = make_params(sets["hidden"], device, dtype, 0), make_params(sets["other"], device, dtype, 1)
    opt = MuonAdamW([{"params": hidden, "kind": "muon", "lr": MUON_LR, "weight_decay": WD, "polar_dtype": polar_dtype,
                      "polar_method": polar_method},
                     {"params": other, "kind": "adamw", "lr": ADAMW_LR, "weight_decay": WD}])
    if compiled:
        # The kernels are torch.library ops, so they become graph nodes; the
        # planning stage (checks) stays eager behind a graph break.
        torch._dynamo.reset()
        opt.step = torch.compile(opt.step)
    return hidden + other, [opt]


def build_seed(module, sets, device, dtype):
    hidden, other = make_params(sets["hidden"], device, dtype, 0), make_params(sets["other"], device, dtype, 1)
    by_shape = {}
    for p in hidden:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    groups = [{"params": ps, "kind": "muon", "lr": MUON_LR, "momentum": 0.95, "weight_decay": WD, "beta2": 0.95,
               "ns_steps": 5} for ps in by_shape.values()]
    groups.append({"params": other, "kind": "adamw", "lr": ADAMW_LR, "betas": (0.9, 0.999), "eps": 1e-8,
                   "weight_decay": WD})
    return hidden + other, [module.MuonAdamW(groups)]


def build_torch(sets, device, dtype):
    hidden, other = make_params(sets["hidden"], device, dtype, 0), make_params(sets["other"], device, dtype, 1)
    muon = torch.optim.Muon(hidden, lr=MUON_LR, weight_decay=WD)
    adamw = torch.optim.AdamW(other, lr=ADAMW_LR, weight_decay=WD, fused=True)
    return hidden + other, [muon, adamw]


def state_bytes(optimizers):
    """Bytes of every tensor in the optimizers' state (each storage counted once)."""
    seen, total = set(), 0
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    key = (value.untyped_storage().data_ptr(), value.device)
                    if key not in seen:
                        seen.add(key)
                        total += value.untyped_storage().nbytes()
    return total


class Contender:
    """One contender's params and optimizers, with what is measured of them
    outside the timed steps (bytes per param; on GPU held and peak memory)."""

    def __init__(self, name, build, device, warmup):
        self.name, self.result, self.params, self.optimizers = name, {}, [], []
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device)
        try:
            self.params, self.optimizers = build()
            for _ in range(warmup):  # the seed and torch create their state lazily
                self.step()
        except Exception as exc:  # a peer unavailable on this device / torch, or out of memory
            self.fail(exc)
            return
        n = sum(p.numel() for p in self.params)
        param_bytes = sum(p.nbytes for p in self.params)
        grad_bytes = sum(p.grad.nbytes for p in self.params)
        s_bytes = state_bytes(self.optimizers)
        self.result = {"numel": n, "persistent_bytes_per_param": (param_bytes + s_bytes) / n,
                       "state_bytes_per_param": s_bytes / n}
        if device.type == "cuda":  # other contenders allocate nothing meanwhile
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated(device) - base
            self.result["held_beyond_params_grads_state_bytes"] = held - param_bytes - grad_bytes - s_bytes
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            self.step()
            torch.cuda.synchronize()
            self.result["step_peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - before

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def fail(self, exc):
        self.result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"  {self.name}: {self.result['error']}", flush=True)
        self.params, self.optimizers = [], []

    @property
    def ok(self):
        return "error" not in self.result


def measure_all(contenders, device, warmup, rounds, iters, one_at_a_time, clock="wall"):
    """Seconds per step (median over interleaved rounds, min, max) and bytes per
    param of every contender; {"error": ...} for one that can't run here."""
    def time_them(built):
        errors = {}
        samples = interleaved_samples({c.name: c.step for c in built if c.ok}, device, rounds=rounds, iters=iters,
                                      round_warmup=0 if device.type == "cpu" else 1, errors=errors, clock=clock)
        for c in built:
            if c.name in errors:
                c.fail(RuntimeError(errors[c.name]))
            elif c.ok:
                s = spread(samples[c.name])
                c.result.update({"seconds": s["median"], "seconds_min": s["min"], "seconds_max": s["max"],
                                 "rounds": s["samples"]})
                print(f"  {c.name}: {s['median'] * 1e3:.2f} ms/step ({s['min'] * 1e3:.2f}..{s['max'] * 1e3:.2f} "
                      f"over {s['samples']} rounds), {c.result['persistent_bytes_per_param']:.2f} B/param", flush=True)

    measured = {}
    if one_at_a_time:
        for name, build in contenders.items():
            contender = Contender(name, build, device, warmup)
            time_them([contender])
            measured[name] = contender.result
            del contender
    else:
        built = [Contender(name, build, device, warmup) for name, build in contenders.items()]
        time_them(built)
        measured = {c.name: c.result for c in built}
    return measured


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results/step.json")
    parser.add_argument("--avx2-host", action="store_true", help="CPU only: cap oneDNN/MKL/ATen at AVX2")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (one sample per contender each)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build, time and free each contender in turn (no interleaving; less memory)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="CPU: time by the process's CPU time, not wall time (robust to a loaded host at --threads 1)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.avx2_host:
        reexec_as_avx2_host()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_gpu = device.type == "cuda"
    warmup, iters = (3, 5) if on_gpu else (3, 1)  # per round: one step each on the CPU
    seed = load_seed(compiled=on_gpu)

    clock = "process" if args.cpu_time and not on_gpu else "wall"
    results = {"benchmark": "step", "environment": environment(device), "clock": clock, "cases": [],
               "notes": ["ours = muon_ext.MuonAdamW, BF16 params + int16 remainders (exact FP32 masters)",
                         f"seed: {'torch.compile' if on_gpu else 'eager'}, one Muon group per shape",
                         "torch: torch.optim.Muon (hidden) + torch.optim.AdamW(fused=True) (rest)",
                         "bytes per param: params + optimizer state, from the tensors, after warmup",
                         "speedup_of_ours_bf16_remainder: peer seconds / ours seconds (> 1: ours is faster)",
                         "seconds: median over interleaved rounds (seconds_min, seconds_max: the spread)" if
                         not args.one_at_a_time else "seconds: median, contenders timed one after the other",
                         "ours orthogonalizes with BF16 operands (polar_dtype='bfloat16', the default; on CPU "
                         "muon_ext.ops.cpu_bf16_gemm() says whether natively or as FP32 GEMMs on BF16 values); "
                         "*_fp32_polar: polar_dtype='float32'; *_gram: polar_method='gram' (Gram Newton-Schulz on "
                         "every hidden matrix, not the default). The seed and torch.optim.Muon use BF16 GEMMs"]}
    if seed is None:
        results["notes"].append("../shared absent: seed peer skipped")
    for set_name, sets in param_sets(device).items():
        print(f"{set_name}: {numel(sets['hidden'])} Muon + {numel(sets['other'])} AdamW params", flush=True)
        contenders = {
            "ours_bf16_remainder": lambda: build_ours(sets, device, torch.bfloat16),
            "ours_bf16_remainder_compiled": lambda: build_ours(sets, device, torch.bfloat16, compiled=True),
            "ours_fp32": lambda: build_ours(sets, device, torch.float32),
            **({} if on_gpu else {"ours_bf16_remainder_fp32_polar":
                                  lambda: build_ours(sets, device, torch.bfloat16, polar_dtype="float32"),
                                  "ours_bf16_remainder_gram":
                                  lambda: build_ours(sets, device, torch.bfloat16, polar_method="gram")}),
            "torch_muon_adamw_fused_fp32": lambda: build_torch(sets, device, torch.float32),
            "torch_muon_adamw_fused_bf16": lambda: build_torch(sets, device, torch.bfloat16),
        }
        if seed is not None:
            contenders["seed_fp32"] = lambda: build_seed(seed, sets, device, torch.float32)
            contenders["seed_bf16"] = lambda: build_seed(seed, sets, device, torch.bfloat16)
        measured = measure_all(contenders, device, warmup, args.rounds, iters, args.one_at_a_time, clock)
        ours = measured["ours_bf16_remainder"].get("seconds")
        case = {"params": set_name, "muon_numel": numel(sets["hidden"]), "adamw_numel": numel(sets["other"]),
                "tensors": len(sets["hidden"]) + len(sets["other"]), "contenders": measured,
                "speedup_of_ours_bf16_remainder": {} if ours is None else {
                    name: r["seconds"] / ours for name, r in measured.items()
                    if "seconds" in r and name != "ours_bf16_remainder"}}
        gram, peer = (measured.get(k, {}).get("seconds") for k in ("ours_bf16_remainder_gram",
                                                                     "torch_muon_adamw_fused_fp32"))
        if gram and peer:
            case["speedup_of_ours_bf16_remainder_gram_vs_torch_muon_adamw_fused_fp32"] = peer / gram
        results["cases"].append(case)
        write_json(args.out, results)  # after every set: a stage cut short still reports what it measured
    for case in results["cases"]:  # the ratios after the JSON, where a terminal shows them
        print(f"{case['params']}: ours_bf16_remainder is "
              + ", ".join(f"{v:.2f}x {k}" for k, v in case["speedup_of_ours_bf16_remainder"].items()))
        gram = case.get("speedup_of_ours_bf16_remainder_gram_vs_torch_muon_adamw_fused_fp32")
        if gram:
            print(f"{case['params']}: ours_bf16_remainder_gram is {gram:.2f}x torch_muon_adamw_fused_fp32")


if __name__ == "__main__":
    main()
