"""Step overhead: what a MuonAdamW step costs outside the kernels.

1000 tiny params (500 Muon 4x4 with ns_steps=0, 500 AdamW of 4 elements), one
thread, FP32 params; and a small GPT's parameters (d=128, L=2) for a step
where kernels matter. Reported per step: process CPU time (robust on a shared
host at one thread: time spent descheduled is not counted) and wall time,
median and best over `--steps` steps.

To compare two trees (issue #20's before/after), run this file from each with
PYTHONPATH pointing at the tree, alternating, several times:

    for i in 1 2 3; do for t in /tmp/before .; do PYTHONPATH=$t python bench/overhead.py --label $t; done; done

`--entry torch_ops` sends the two step ops through torch.ops.muon_ext.* instead
of their pybind eager entries (muon_ext.ops._entry), to measure what the
eager entry saves (docs/design.md, "Ops (torch.library)").

`--scale N`: N tiny params (N/2 Muon 4x4 with ns_steps=0, N/2 AdamW of 4
elements, FP32, one thread) instead: construction, the first step, state_dict,
load_state_dict (of its own state dict) and a step after it, wall seconds,
and the resident memory each param's state adds, for MuonAdamW and, side by
side on the same params, torch.optim.AdamW (foreach=False; its state is made
at its first step). torch's load_state_dict scans its group's param list once
per state tensor (quadratic: 1.9 s at 10k params, about 3 hours at 200k), so
it is timed on the first `--torch-load-params` params only (default 20000).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

import torch


def tiny_params(n: int = 500):
    g = torch.Generator().manual_seed(0)
    muon = [torch.nn.Parameter(torch.randn(4, 4, generator=g)) for _ in range(n)]
    adamw = [torch.nn.Parameter(torch.randn(4, generator=g)) for _ in range(n)]
    for p in muon + adamw:
        p.grad = torch.randn(p.shape, generator=g)
    return [{"params": muon, "kind": "muon", "ns_steps": 0, "lr": 1e-3},
            {"params": adamw, "kind": "adamw", "lr": 1e-3}]


def gpt_params(d: int = 128, layers: int = 2, vocab: int = 2048):
    g = torch.Generator().manual_seed(0)
    hidden, other = [], [(vocab, d), (d,)]
    for _ in range(layers):
        hidden += [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
        other += [(d,)] * 4
    make = lambda shapes: [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
    muon, adamw = make(hidden), make(other)
    for p in muon + adamw:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    return [{"params": muon, "kind": "muon", "lr": 1e-3}, {"params": adamw, "kind": "adamw", "lr": 1e-3}]


def measure(groups, steps: int) -> dict:
    from muon_ext import MuonAdamW
    opt = MuonAdamW(groups)
    for _ in range(5):
        opt.step()
    cpu, wall = [], []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        opt.step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    ms = lambda xs: {"median": 1e3 * statistics.median(xs), "best": 1e3 * min(xs)}
    return {"cpu_ms": ms(cpu), "wall_ms": ms(wall)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def scale(n: int, torch_load_params: int) -> dict:
    """Construction, state_dict and load_state_dict at `n` tiny params, MuonAdamW beside torch.optim.AdamW,
    each in a child process forked from this one (so that neither's memory figure reuses the other's)."""
    from muon_ext import MuonAdamW
    MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(2))], "kind": "adamw"}])  # imports, first-call setup
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    groups = tiny_params(n // 2)
    ctx = multiprocessing.get_context("fork")
    out = {"params": n}
    for name, measure_one in (("muon_ext", _muon_ext_scale), ("torch_adamw", _torch_scale)):
        queue = ctx.Queue()
        child = ctx.Process(target=lambda: queue.put(measure_one(groups, n, torch_load_params)))
        child.start()
        out[name] = queue.get()
        child.join()
    return out


def _muon_ext_scale(groups, n: int, torch_load_params: int) -> dict:
    from muon_ext import MuonAdamW
    holder = {}
    rss = _rss_bytes()
    ours = {"construct_s": _timed(lambda: holder.update(opt=MuonAdamW(groups)))}
    ours["state_bytes_per_param"] = (_rss_bytes() - rss) / n
    opt = holder["opt"]
    ours["first_step_s"] = _timed(opt.step)
    ours["state_dict_s"] = _timed(lambda: holder.update(sd=opt.state_dict()))
    ours["load_state_dict_s"] = _timed(lambda: opt.load_state_dict(holder["sd"]))
    ours["step_after_load_s"] = _timed(opt.step)
    return ours


def _torch_scale(groups, n: int, torch_load_params: int) -> dict:
    holder = {}
    params = [p for g in groups for p in g["params"]]
    rss = _rss_bytes()
    theirs = {"construct_s": _timed(lambda: holder.update(opt=torch.optim.AdamW(params, lr=1e-3, foreach=False)))}
    opt = holder["opt"]
    theirs["first_step_s"] = _timed(opt.step)
    theirs["state_bytes_per_param"] = (_rss_bytes() - rss) / n
    theirs["state_dict_s"] = _timed(lambda: holder.update(sd=opt.state_dict()))
    subset = params[:min(n, torch_load_params)]
    small = torch.optim.AdamW(subset, lr=1e-3, foreach=False)
    small.step()
    small_sd = small.state_dict()
    theirs[f"load_state_dict_s_at_{len(subset)}_params"] = _timed(lambda: small.load_state_dict(small_sd))
    return theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gpt-steps", type=int, default=20)
    parser.add_argument("--label", default="")
    parser.add_argument("--entry", choices=("eager", "torch_ops"), default="eager")
    parser.add_argument("--tiny-only", action="store_true",
                        help="only the tiny-params case, --steps steps after 5 warm-up steps, no timing output "
                             "(for instruction counts: run under valgrind --tool=callgrind at two --steps and "
                             "divide the difference of the totals by the difference of the steps)")
    parser.add_argument("--scale", type=int, default=0,
                        help="construction and checkpoints at this many tiny params, beside torch.optim.AdamW")
    parser.add_argument("--torch-load-params", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.scale:
        print(json.dumps({"label": args.label, "scale": scale(args.scale, args.torch_load_params)}))
        return
    import muon_ext
    if args.entry == "torch_ops":
        from muon_ext import ops
        ops._entry = lambda name, first, checked: (getattr(torch.ops.muon_ext, name), {})
    if args.tiny_only:
        from muon_ext import MuonAdamW
        opt = MuonAdamW(tiny_params())
        for _ in range(5 + args.steps):
            opt.step()
        return
    result = {"label": args.label, "entry": args.entry, "muon_ext": muon_ext.__file__,
              "tiny_1000": measure(tiny_params(), args.steps),
              "gpt_d128_L2_bf16": measure(gpt_params(), args.gpt_steps)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
