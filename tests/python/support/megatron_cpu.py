"""Test-only: run megatron-core 0.16.1 on the CPU (gloo).

megatron-core hard-codes CUDA in a few places that a CPU run reaches
(tensor_parallel/random.py's CUDA RNG calls, `device=torch.cuda.current_device()`
in utils.py and distributed/param_and_grad_buffer.py, `device='cuda'` in
optimizer/optimizer.py and clip_grads.py, clip_grads.py's assert on
`grad.type() == 'torch.cuda.FloatTensor'`). `megatron_on_cpu()` maps them to the
CPU for the duration of a `with` block: a TorchFunctionMode turns CUDA device
arguments into the CPU, `torch.cuda.current_device` answers 0,
`synchronize` / `empty_cache` do nothing, the CUDA RNG calls act on the CPU
generator, `Tensor.cuda` is the identity and `Tensor.type()` names CPU tensors
as their CUDA types. Nothing here is part of muon_ext.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_on_cpu"]

_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.int64: "torch.cuda.LongTensor",
                    torch.int32: "torch.cuda.IntTensor", torch.uint8: "torch.cuda.ByteTensor",
                    torch.bool: "torch.cuda.BoolTensor"}


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a CUDA ordinal (Megatron passes torch.cuda.current_device())
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA `device=` arguments (and `.to('cuda')`) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        return _CUDA_TYPE_NAMES.get(self.dtype, _ORIGINAL_TYPE(self))
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda."):]
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


_ORIGINAL_TYPE = torch.Tensor.type


@contextlib.contextmanager
def megatron_on_cpu():
    """Within the block, megatron-core's CUDA calls run on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(*args, **kwargs):
        return torch.get_rng_state()

    def set_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    replaced = [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "empty_cache", lambda: None),
        (torch.cuda, "get_rng_state", get_state),
        (torch.cuda, "set_rng_state", set_state),
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (torch.cuda, "manual_seed_all", lambda seed: None),  # torch.manual_seed calls it: no CUDA generators
        (mrandom, "_get_cuda_rng_state", get_state),
        (mrandom, "_set_cuda_rng_state", set_state),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (torch.Tensor, "type", _type),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    for owner, name, value in replaced:
        setattr(owner, name, value)
    try:
        with _CudaToCpu():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
