"""Shared benchmark utilities: timing, GPT-like parameter sets, JSON output."""

from __future__ import annotations

import json
import os
import platform
import sys
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch


def time_fn(fn: Callable[[], None], device: torch.device, warmup: int = 3, iters: int = 20,
            clock: str = "wall") -> float:
    """Median seconds per call of `fn` (CUDA events on GPU; on CPU perf_counter, or
    with clock="process" the process's CPU time, all threads together: at one
    thread it does not count the time the host ran other work)."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        now = time.process_time if clock == "process" else time.perf_counter
        for _ in range(iters):
            t0 = now()
            fn()
            samples.append(now() - t0)
    return statistics.median(samples)


def interleaved_samples(fns: Dict[str, Callable[[], None]], device: torch.device, rounds: int = 5,
                        iters: int = 5, warmup: int = 0, round_warmup: int = 1,
                        errors: Optional[Dict[str, str]] = None, clock: str = "wall") -> Dict[str, List[float]]:
    """Seconds per call of each fn, one sample per round (the median of `iters`
    calls after `round_warmup` uncounted ones), in interleaved rounds (every
    contender in turn) so that drift in machine speed (shared hosts, turbo,
    thermals) hits every contender alike.  `warmup` calls of each fn come first.
    With `errors` given, a fn that raises is recorded there (name: message) and
    left out of the later rounds, keeping the samples it had; else it raises.
    `clock`: see time_fn."""
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    live = dict(fns)

    def call(name, run):
        if errors is None:
            return run()
        try:
            return run()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"  {name}: {errors[name]}", flush=True)
            del live[name]
            return None

    for name, fn in list(live.items()):
        call(name, lambda: [fn() for _ in range(warmup)])
    for _ in range(rounds):
        for name, fn in list(live.items()):
            seconds = call(name, lambda: time_fn(fn, device, warmup=round_warmup, iters=iters, clock=clock))
            if seconds is not None:
                samples[name].append(seconds)
    return samples


def spread(values: List[float]) -> Dict[str, float]:
    """Median, min and max of a contender's samples."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": len(values)}


def time_interleaved(fns: Dict[str, Callable[[], None]], device: torch.device, rounds: int = 5,
                     iters: int = 5, clock: str = "wall") -> Dict[str, float]:
    """Median seconds per call of each fn over interleaved rounds (interleaved_samples)."""
    samples = interleaved_samples(fns, device, rounds=rounds, iters=iters, clock=clock)
    return {name: statistics.median(values) for name, values in samples.items()}


def with_env(step: Callable[[], None], **settings: str) -> Callable[[], None]:
    """`step` with environment variables set during each call (and restored
    after): a contender that runs the same code under another setting, such as
    MUON_EXT_CUDA_BLOCKS_PER_LAUNCH, interleaved with the default in one process."""
    def run():
        saved = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        try:
            step()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return run


def gpt_shapes(d_model: int, n_layers: int, vocab: int, seq: int = 1024) -> Dict[str, List[Tuple[int, ...]]]:
    """Parameter shapes of a GPT-2-like model, split the way Muon + AdamW split them."""
    hidden = []
    other = [(vocab, d_model), (seq, d_model), (d_model,), (d_model,)]  # embeddings, final norm
    for _ in range(n_layers):
        hidden += [(3 * d_model, d_model), (d_model, d_model), (4 * d_model, d_model), (d_model, 4 * d_model)]
        other += [(d_model,)] * 4 + [(3 * d_model,), (d_model,), (4 * d_model,), (d_model,)]  # norms + biases
    return {"hidden": hidden, "other": other}


def numel(shapes) -> int:
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        total += n
    return total


# Caps oneDNN, MKL and ATen at AVX2. On such a CPU oneDNN has no BF16 GEMM and
# torch falls back to a scalar loop (about 1 GFLOP/s against ~200 in FP32 here),
# which is where bf16-matmul optimizers such as torch.optim.Muon spend seconds.
AVX2_HOST_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def reexec_as_avx2_host() -> None:
    """Restart this script with AVX2_HOST_ENV set (the libraries read it at load time)."""
    if all(os.environ.get(k) == v for k, v in AVX2_HOST_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **AVX2_HOST_ENV})


def cpu_gemm_rates(n: int = 1024) -> Dict[str, float]:
    """FLOP/s of one n x n x n matmul in FP32 and BF16 on the CPU (median of 3)."""
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        rates[str(dtype).replace("torch.", "")] = 2 * n**3 / time_fn(lambda: a @ b, torch.device("cpu"), 1, 3)
    return rates


# The CPU features that decide our paths and the peers' speed (BF16 GEMM or not, AMX or not).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_identity() -> dict:
    """The CPU's model, family/model numbers, logical CPUs and CPU_FLAGS present, from /proc/cpuinfo
    (Linux; elsewhere the platform's processor string only): results from different hosts stay apart."""
    info = {"processor": platform.processor(), "logical_cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    first = text.split("\n\n", 1)[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    info.update({"model_name": fields.get("model name"), "family": fields.get("cpu family"),
                 "model": fields.get("model"), "flags": [f for f in CPU_FLAGS if f in fields.get("flags", "").split()]})
    return info


def environment(device: torch.device) -> dict:
    env = {"torch": str(torch.__version__), "python": platform.python_version(), "device": str(device),
           "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["cpu"] = cpu_identity()
        env["isa_caps"] = {k: os.environ[k] for k in AVX2_HOST_ENV if k in os.environ}
        env["gemm_flops_per_s"] = cpu_gemm_rates()
        from muon_ext import ops  # how BF16 Polar-Express multiplies here: "native" or "rounded"
        env["muon_ext_cpu_bf16_gemm"] = ops.cpu_bf16_gemm()
        env["muon_ext_cpu_bf16_tile_gemm"] = ops.cpu_bf16_tile_gemm()
    return env


def write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload, indent=2))
