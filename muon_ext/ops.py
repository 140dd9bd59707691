"""The kernels of muon_ext, callable directly.

Thin wrappers over the compiled module: they normalize Python scalars and
tensors and dispatch to the CPU or CUDA kernel by the params' device. The
argument checks themselves live in the compiled boundary (csrc/bindings.cpp),
so every entry point, Python or C++, validates before it writes anything.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _C

__all__ = ["adamw_step", "cpu_capabilities"]


def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    masters: Sequence[torch.Tensor] = (),
    lr: Union[float, torch.Tensor],
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    inv_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """One AdamW (or Adam-L2) step on a list of tensors, in place.

    Master modes, chosen by `masters`:
      * empty: each param is its own master (FP32, or BF16/FP16 updated directly
        with FP32 math and a round-to-nearest-even write-back);
      * FP32 tensors: BF16/FP16 params with separate FP32 masters;
      * int16 tensors: BF16 params with int16 remainders (TransformerEngine's
        convention; the param and remainder together are the exact FP32 master).
    `steps` are one-element FP32 counters, incremented before use. `lr` is a
    float or a one-element FP32 tensor. `inv_scale` multiplies the grads; a
    nonzero `found_inf` turns the call into a no-op (counters included). All
    tensors share the params' device; on CUDA the call never syncs the host.
    Raises (TypeError / ValueError) before touching anything on bad input.
    """
    lr_value, lr_tensor = _split_lr(lr, params)
    _C.adamw_step(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(masters),
        list(steps),
        lr_value,
        lr_tensor,
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adam_w_mode),
        bool(bias_correction),
        inv_scale,
        found_inf,
    )


def _split_lr(lr, params):
    """A host float, or a device tensor the kernel reads (a CPU tensor for device params is read here)."""
    if not isinstance(lr, torch.Tensor):
        return float(lr), None
    if len(params) == 0:
        return 0.0, None
    on_params_device = len(params) > 0 and lr.device == params[0].device
    if on_params_device:
        return 0.0, lr
    if lr.device.type == "cpu":
        return float(lr.item()), None
    raise ValueError(f"adamw_step: lr is on {lr.device} but params are on {params[0].device}")


def cpu_capabilities() -> list:
    """Instruction sets of the CPU kernels usable on this machine, best (used) last."""
    return list(_C.cpu_capabilities())
