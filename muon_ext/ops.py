"""The kernels of muon_ext, callable directly.

Thin wrappers over the compiled module: they normalize Python scalars and
tensors and dispatch to the CPU or CUDA kernel by the params' device. The
argument checks themselves live in the compiled boundary (csrc/bindings.cpp),
so every entry point, Python or C++, validates before it writes anything.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from . import _C

__all__ = [
    "adamw_step",
    "muon_step",
    "split_master",
    "merge_master",
    "cpu_capabilities",
    "POLAR_EXPRESS_COEFFICIENTS",
]

# (a, b, c) per Polar-Express iteration, the default of muon_step (from csrc/common/muon_math.h).
POLAR_EXPRESS_COEFFICIENTS = tuple(tuple(abc) for abc in _C.polar_express_coefficients())

# Default bound on the Muon scratch per chunk of matrices.
DEFAULT_MAX_WORKSPACE_BYTES = 1 << 30


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


def muon_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    second_momentum_buffers: Sequence[torch.Tensor] = (),
    *,
    masters: Sequence[torch.Tensor] = (),
    lr: Union[float, torch.Tensor],
    momentum: float = 0.95,
    nesterov: bool = True,
    beta2: Optional[float] = 0.95,
    weight_decay: float = 0.1,
    ns_steps: int = 5,
    ns_coefficients: Optional[Sequence[Sequence[float]]] = None,
    lr_scale: str = "original",
    inv_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
    polar_row_blocks: Optional[int] = None,
) -> None:
    """One Muon step on a bucket of same-shape matrices, in place.

    Each param is [..., rows, cols] (leading dims index separate matrices), all
    with the same (rows, cols). `momentum_buffers` are FP32 and param-shaped;
    `second_momentum_buffers` are FP32 of shape [..., rows, 1] if rows >= cols
    else [..., 1, cols], and must be empty when `beta2` is None (NorMuon off).
    `masters` select the master mode as in `adamw_step`. The update is
    momentum (Nesterov), Polar-Express orthogonalization with `ns_steps` of the
    (a, b, c) tuples (BF16 GEMMs on CUDA, FP32 on CPU), NorMuon, lr scaling by
    `lr_scale` ("original", "match_rms_adamw", "none") and cautious weight
    decay on the FP32 master; see DESIGN.md. Matrices are processed in chunks
    whose scratch stays under `max_workspace_bytes` (at least one matrix).
    `polar_row_blocks` (1..64) splits the symmetric products X X^T and A A into
    that many row blocks and multiplies only the upper block triangle (1: plain
    GEMMs); None takes the device's choice (CPU: side / 128, clamped to 1..8;
    CUDA: 1). It changes rounding only, never the math.
    `inv_scale` / `found_inf` behave as in `adamw_step`; on CUDA the call never
    syncs the host. Raises (TypeError / ValueError) before touching anything.
    """
    lr_value, lr_tensor = _split_lr(lr, params)
    coefficients = POLAR_EXPRESS_COEFFICIENTS if ns_coefficients is None else ns_coefficients
    _C.muon_step(
        list(params),
        list(grads),
        list(momentum_buffers),
        list(second_momentum_buffers),
        list(masters),
        lr_value,
        lr_tensor,
        float(momentum),
        bool(nesterov),
        None if beta2 is None else float(beta2),
        float(weight_decay),
        int(ns_steps),
        [[float(v) for v in abc] for abc in coefficients],
        str(lr_scale),
        inv_scale,
        found_inf,
        int(max_workspace_bytes),
        _optional_int(polar_row_blocks, "polar_row_blocks"),
    )


def split_master(
    master: torch.Tensor, param: Optional[torch.Tensor] = None, remainder: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 masters into (BF16 param, int16 remainder), TransformerEngine's
    convention (round half up on the bit pattern; exact round trip).

    Writes into `param` / `remainder` when given (contiguous, same shape and
    device as `master`), else into new tensors; returns both.
    """
    param = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device) if param is None else param
    remainder = torch.empty(master.shape, dtype=torch.int16, device=master.device) if remainder is None else remainder
    _C.split_master(master, param, remainder)
    return param, remainder


def merge_master(param: torch.Tensor, remainder: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The exact FP32 masters held by BF16 params and int16 remainders."""
    out = torch.empty(param.shape, dtype=torch.float32, device=param.device) if out is None else out
    _C.merge_master(param, remainder, out)
    return out


def _optional_int(value, name):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return value


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
