"""Shared benchmark utilities: timing, GPT-like parameter sets, JSON output."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch


def time_fn(fn: Callable[[], None], device: torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds per call of `fn` (CUDA events on GPU, perf_counter on CPU)."""
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
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def time_interleaved(fns: Dict[str, Callable[[], None]], device: torch.device, rounds: int = 5,
                     iters: int = 5) -> Dict[str, float]:
    """Median seconds per call of each fn, measured in interleaved rounds so that
    drift in machine speed (shared hosts, turbo, thermals) hits every contender alike."""
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(time_fn(fn, device, warmup=1, iters=iters))
    return {name: statistics.median(values) for name, values in samples.items()}


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


def environment(device: torch.device) -> dict:
    env = {"torch": str(torch.__version__), "python": platform.python_version(), "device": str(device),
           "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return env


def write_json(path: str, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload, indent=2))
