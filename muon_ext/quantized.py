"""FP8 (float8_e4m3fn) copies of FP32 masters, scaled per block or per tensor.

The format of DeepSeek-V3 / SGLang FP8 weights: `q` of the master's shape and
FP32 `scale_inv`, one per `block` (rows, cols) of a 2-D master (edge blocks
partial) or one per tensor (`block=None`), with `q * scale_inv` the value.
Exact rule (csrc/common/fp8.h; `muon_ext.reference.quantize_fp8` is its
plain-PyTorch twin, and CPU and CUDA give the same bits):

    amax      = max |x| over the block's finite elements (0 if none)
    scale_inv = amax / 448 in FP32, or 1 where that is 0
    q         = e4m3fn(x / scale_inv) (FP32 division), round to nearest even,
                saturating: |.| >= 448 and +-inf give +-448, NaN gives NaN

`Fp8Writer` is a param writer (the optimizer's writer protocol) that keeps such
a copy of a param's master up to date.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import ops, reference
from .writers import stream_context

__all__ = ["DEFAULT_BLOCK", "quantize_fp8", "dequantize_fp8", "scale_inv_shape", "Fp8Writer"]

DEFAULT_BLOCK = (128, 128)
Block = Optional[Tuple[int, int]]

_ops = torch.ops.muon_ext


def _check_block(op: str, block) -> Block:
    if block is None:
        return None
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        raise ValueError(f"{op}: block must be two positive ints (rows, cols) or None, got {block!r}")
    return int(block[0]), int(block[1])


def _require_tensor(op: str, name: str, value, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {dtype}, got {value.dtype}")
    return value


def _scale_shape(op: str, shape, block: Block) -> Tuple[int, ...]:
    shape = tuple(shape)
    if block is None:
        return ()
    if len(shape) != 2:
        raise ValueError(f"{op}: block={block} needs a 2-D tensor, got shape {shape} (block=None gives one scale "
                         "for any shape)")
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def scale_inv_shape(shape, block: Block = DEFAULT_BLOCK) -> Tuple[int, ...]:
    """The shape of `scale_inv` for a master of `shape`: () with block=None,
    else (ceil(rows / block[0]), ceil(cols / block[1])) for a 2-D shape."""
    return _scale_shape("scale_inv_shape", shape, _check_block("scale_inv_shape", block))


def quantize_fp8(
    master: torch.Tensor,
    *,
    block: Block = DEFAULT_BLOCK,
    out: Optional[torch.Tensor] = None,
    out_scale_inv: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) of an FP32 `master` by the rule in the module docstring.

    Writes into `out` (float8_e4m3fn, master's shape) and `out_scale_inv`
    (FP32, `scale_inv_shape(master.shape, block)`) when given, else into new
    tensors; all on master's device, contiguous, not overlapping master. A
    non-contiguous master is quantized from a contiguous copy (outputs must
    then not share its storage at all). A nonzero
    `found_inf` (one-element FP32 tensor on master's device) makes the call
    write nothing, checked on the device: no host sync on CUDA, where the call
    is one kernel launch with blocks and two with block=None.
    """
    op = "quantize_fp8"
    _require_tensor(op, "master", master, torch.float32)
    block = _check_block(op, block)
    if not master.is_contiguous():
        problem = ops.storage_problem(master)
        if problem:  # .contiguous() would read out of bounds
            raise ValueError(f"{op}: master: {problem}")
        # The op sees only the copy, so it could not tell that an output overlaps master.
        for name, t in (("out", out), ("out_scale_inv", out_scale_inv)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
                raise ValueError(f"{op}: {name} shares its storage with the non-contiguous master")
        master = master.contiguous()
    if out is None:
        out = torch.empty(master.shape, dtype=torch.float8_e4m3fn, device=master.device)
    if out_scale_inv is None:
        out_scale_inv = torch.empty(_scale_shape(op, master.shape, block), dtype=torch.float32, device=master.device)
    _require_tensor(op, "out", out, torch.float8_e4m3fn)
    _require_tensor(op, "out_scale_inv", out_scale_inv, torch.float32)
    if found_inf is not None:
        _require_tensor(op, "found_inf", found_inf, torch.float32)
    _ops.quantize_fp8(master, block, out, out_scale_inv, found_inf)
    return out, out_scale_inv


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, *, block: Block = DEFAULT_BLOCK) -> torch.Tensor:
    """FP32 values of (q, scale_inv): q * scale_inv of its block (exact products)."""
    op = "dequantize_fp8"
    _require_tensor(op, "q", q, torch.float8_e4m3fn)
    _require_tensor(op, "scale_inv", scale_inv, torch.float32)
    block = _check_block(op, block)
    expected = _scale_shape(op, q.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{op}: scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for q of shape "
                         f"{tuple(q.shape)} and block={block}")
    if scale_inv.device != q.device:
        raise ValueError(f"{op}: scale_inv is on {scale_inv.device} but q is on {q.device}")
    return reference.dequantize_fp8(q, scale_inv, block=block)


class Fp8Writer:
    """Param writer keeping an FP8 copy of a param's master in caller-owned
    buffers: `q_out` (float8_e4m3fn, the param's shape) and `scale_inv_out`
    (FP32, `scale_inv_shape(q_out.shape, block)`), e.g. an inference engine's
    weights. Buffers are checked here; each call checks the master against
    them before writing.

    `writer(param, master, stream, found_inf)`: quantize_fp8(master) into the
    buffers, on `stream` when one is given (None on the CPU); a nonzero
    `found_inf` leaves them untouched. `param` is not read or written.
    """

    def __init__(self, q_out: torch.Tensor, scale_inv_out: torch.Tensor, block: Block = DEFAULT_BLOCK):
        op = "Fp8Writer"
        _require_tensor(op, "q_out", q_out, torch.float8_e4m3fn)
        _require_tensor(op, "scale_inv_out", scale_inv_out, torch.float32)
        self.block = _check_block(op, block)
        expected = _scale_shape(op, q_out.shape, self.block)
        if tuple(scale_inv_out.shape) != expected:
            raise ValueError(f"{op}: scale_inv_out has shape {tuple(scale_inv_out.shape)}, expected {expected} for "
                             f"q_out of shape {tuple(q_out.shape)} and block={self.block}")
        if scale_inv_out.device != q_out.device:
            raise ValueError(f"{op}: scale_inv_out is on {scale_inv_out.device} but q_out is on {q_out.device}")
        for name, t in (("q_out", q_out), ("scale_inv_out", scale_inv_out)):
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous")
            problem = ops.storage_problem(t)
            if problem:
                raise ValueError(f"{op}: {name}: {problem}")
        self.q_out = q_out
        self.scale_inv_out = scale_inv_out

    def check_param(self, param: torch.Tensor) -> None:
        """At registration: the param must have the shape and device of `q_out` (its master will)."""
        if tuple(param.shape) != tuple(self.q_out.shape) or param.device != self.q_out.device:
            raise ValueError(f"Fp8Writer: q_out has shape {tuple(self.q_out.shape)} on {self.q_out.device}, the "
                             f"param {tuple(param.shape)} on {param.device}")

    def __call__(self, param: torch.Tensor, master: torch.Tensor, stream, found_inf: Optional[torch.Tensor]) -> None:
        op = "Fp8Writer"
        _require_tensor(op, "master", master, torch.float32)
        if master.shape != self.q_out.shape or master.device != self.q_out.device:
            raise ValueError(f"{op}: master of shape {tuple(master.shape)} on {master.device} does not fit q_out "
                             f"of shape {tuple(self.q_out.shape)} on {self.q_out.device}")
        with stream_context(stream):
            quantize_fp8(master, block=self.block, out=self.q_out, out_scale_inv=self.scale_inv_out,
                         found_inf=found_inf)
