"""The kernels of muon_ext, callable directly.

Thin wrappers over the `torch.ops.muon_ext.*` custom ops (csrc/ops.cpp; see
docs/design.md, "Ops (torch.library)"): they normalize Python scalars (a float
or tensor lr, nested Polar-Express coefficients) and call the op, which the
dispatcher sends to the CPU, CUDA or Meta kernel by the tensors' device. The
argument checks live in the ops themselves, so every entry point, Python, C++
or a traced graph, validates before it writes anything.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _C

__all__ = [
    "adamw_step",
    "muon_step",
    "muon_momentum",
    "muon_orthogonalize",
    "muon_apply",
    "sharded_polar_norms",
    "sharded_polar_scale",
    "sharded_polar_gram",
    "sharded_polar_iterate",
    "sharded_normuon_partial",
    "sharded_normuon_finish",
    "sharded_normuon_payload_numel",
    "split_master",
    "merge_master",
    "cpu_capabilities",
    "storage_problem",
    "cpu_bf16_gemm",
    "polar_method_for",
    "POLAR_EXPRESS_COEFFICIENTS",
]

# (a, b, c) per Polar-Express iteration, the default of muon_step (from csrc/common/muon_math.h).
POLAR_EXPRESS_COEFFICIENTS = tuple(tuple(abc) for abc in _C.polar_express_coefficients())

# Default bound on the Muon scratch per chunk of matrices.
DEFAULT_MAX_WORKSPACE_BYTES = 1 << 30

_ops = torch.ops.muon_ext


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
    checked: Optional[_C.CheckedBucket] = None,
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
    `checked`: the optimizer's step-check token for exactly these lists (see
    docs/design.md, "Ops (torch.library)"); it only spares checks already
    made, and a token that does not match checks everything.
    """
    if not _has_work("adamw_step", params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps,
                     masters=masters):
        return
    lists = _lists("adamw_step", params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                   masters=masters, steps=steps)
    lr_value, lr_tensor = _split_lr("adamw_step", lr, lists)
    _call("adamw_step", *_entry("adamw_step", params[0], checked), lists, lr=lr_value, lr_tensor=lr_tensor,
          beta1=float(beta1), beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay),
          adam_w_mode=bool(adam_w_mode), bias_correction=bool(bias_correction), inv_scale=inv_scale,
          found_inf=found_inf)


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
    polar_dtype: str = "bfloat16",
    polar_method: str = "standard",
    checked: Optional[_C.CheckedBucket] = None,
) -> None:
    """One Muon step on a bucket of same-shape matrices, in place.

    Each param is [..., rows, cols] (leading dims index separate matrices), all
    with the same (rows, cols). `momentum_buffers` are FP32 and param-shaped;
    `second_momentum_buffers` are FP32 of shape [..., rows, 1] if rows >= cols
    else [..., 1, cols], and must be empty when `beta2` is None (NorMuon off).
    `masters` select the master mode as in `adamw_step`. The update is
    momentum (Nesterov), Polar-Express orthogonalization with `ns_steps` of the
    (a, b, c) tuples, NorMuon, lr scaling by
    `lr_scale` ("original", "match_rms_adamw", "none") and cautious weight
    decay on the FP32 master; see docs/design.md, "Muon in three phases". Matrices are processed in chunks
    whose scratch stays under `max_workspace_bytes` (at least one matrix).
    `polar_row_blocks` (1..64) splits the symmetric products X X^T and A A into
    that many row blocks and multiplies only the upper block triangle (1: plain
    GEMMs); None takes the device's choice (CPU: side / 128, clamped to 1..8;
    CUDA: 1). It changes rounding only, never the math. `polar_dtype`:
    "bfloat16" (BF16 GEMM operands, FP32 accumulation, each GEMM output rounded
    to BF16, on every device; see `cpu_bf16_gemm()`), "float16" (the same in IEEE
    FP16; on the CPU always FP32 GEMMs on FP16 values, outputs rounded) or
    "float32" (FP32 GEMMs; on CUDA TF32 only where torch allows it for its own
    FP32 matmuls). Small matrices (min(rows, cols)^2 * max(rows, cols) <= 2^20)
    run on the CPU sixteen at a time without BLAS calls, where row blocks do not apply.
    `polar_method`: "standard" iterations, "gram" (Gram Newton-Schulz: iterates
    on the min(rows, cols)-square Gram matrix and multiplies the long side
    twice in all; the same polynomial in exact arithmetic) or "auto" (Gram
    where `polar_method_for` says it pays); docs/polar_express.md.
    `inv_scale` / `found_inf` / `checked` behave as in `adamw_step`; on CUDA the
    call never syncs the host. Raises (TypeError / ValueError) before touching anything.
    """
    if not _has_work("muon_step", params, grads=grads, momentum_buffers=momentum_buffers,
                     second_momentum_buffers=second_momentum_buffers, masters=masters):
        return
    lists = _lists("muon_step", params=params, grads=grads, momentum_buffers=momentum_buffers,
                   second_momentum_buffers=second_momentum_buffers, masters=masters)
    lr_value, lr_tensor = _split_lr("muon_step", lr, lists)
    _call("muon_step", *_entry("muon_step", params[0], checked), lists, lr=lr_value, lr_tensor=lr_tensor,
          momentum=float(momentum), nesterov=bool(nesterov), beta2=None if beta2 is None else float(beta2),
          weight_decay=float(weight_decay), ns_steps=int(ns_steps),
          ns_coefficients=_flat_coefficients("muon_step", ns_coefficients, ns_steps), lr_scale=str(lr_scale),
          inv_scale=inv_scale, found_inf=found_inf, max_workspace_bytes=int(max_workspace_bytes),
          polar_row_blocks=_optional_int(polar_row_blocks, "polar_row_blocks"), polar_dtype=str(polar_dtype),
          polar_method=str(polar_method))


def muon_momentum(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    inv_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """Muon phase 1, elementwise on tensors of any shape (whole params or shards):
    `momentum = lerp(momentum, g, 1 - mu)`, `updates = lerp(g, momentum, mu)`
    (Nesterov) or `momentum`, with `g = grad * inv_scale`. `momentum_buffers` and
    `updates` are FP32 and grad-shaped. Phases 1-3 in a row give `muon_step`'s bits.
    """
    if not _has_work("muon_momentum", updates, grads=grads, momentum_buffers=momentum_buffers, base="updates"):
        return
    lists = _lists("muon_momentum", grads=grads, momentum_buffers=momentum_buffers, updates=updates)
    _call("muon_momentum", _ops.muon_momentum, {}, lists, momentum=float(momentum), nesterov=bool(nesterov),
          inv_scale=inv_scale, found_inf=found_inf)


def muon_orthogonalize(
    updates: Sequence[torch.Tensor],
    second_momentum_buffers: Sequence[torch.Tensor] = (),
    *,
    beta2: Optional[float] = 0.95,
    ns_steps: int = 5,
    ns_coefficients: Optional[Sequence[Sequence[float]]] = None,
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
    polar_row_blocks: Optional[int] = None,
    polar_dtype: str = "bfloat16",
    polar_method: str = "standard",
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """Muon phase 2, on whole matrices: each FP32 `updates[i]` ([..., rows, cols],
    one (rows, cols) per call) is scaled by its input norm, orthogonalized by
    Polar-Express (as in `muon_step`, in `polar_dtype`, by `polar_method`)
    and multiplied by its NorMuon multipliers (updating `second_momentum_buffers`,
    shaped as in `muon_step`; empty when `beta2` is None), in place.
    """
    if not _has_work("muon_orthogonalize", updates, second_momentum_buffers=second_momentum_buffers,
                     base="updates", optional=("second_momentum_buffers",)):
        return
    lists = _lists("muon_orthogonalize", updates=updates, second_momentum_buffers=second_momentum_buffers)
    _call("muon_orthogonalize", _ops.muon_orthogonalize, {}, lists, beta2=None if beta2 is None else float(beta2),
          ns_steps=int(ns_steps), ns_coefficients=_flat_coefficients("muon_orthogonalize", ns_coefficients, ns_steps),
          max_workspace_bytes=int(max_workspace_bytes),
          polar_row_blocks=_optional_int(polar_row_blocks, "polar_row_blocks"), polar_dtype=str(polar_dtype),
          polar_method=str(polar_method), found_inf=found_inf)


def muon_apply(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    masters: Sequence[torch.Tensor] = (),
    lr: Union[float, torch.Tensor],
    weight_decay: float = 0.1,
    lr_scale: str = "original",
    matrix_shape: Optional[Tuple[int, int]] = None,
    found_inf: Optional[torch.Tensor] = None,
) -> None:
    """Muon phase 3, elementwise on tensors of any shape (whole params or shards):
    cautious weight decay and the update `updates` (FP32, from phase 2) on each
    FP32 master, written back to the param and its master as in `muon_step`.
    `lr` is scaled by `lr_scale` for matrices of `matrix_shape` (rows, cols; by
    default params[0].shape[-2:], which a shard must pass explicitly).
    """
    if not _has_work("muon_apply", params, updates=updates, masters=masters):
        return
    lists = _lists("muon_apply", params=params, updates=updates, masters=masters)
    if matrix_shape is None:
        _require_tensor("muon_apply", "params[0]", lists["params"][0])
        if params[0].dim() < 2:
            raise ValueError("muon_apply: params[0] is not a matrix; pass matrix_shape=(rows, cols)")
        matrix_shape = tuple(params[0].shape[-2:])
    rows, cols = (int(v) for v in matrix_shape)
    lr_value, lr_tensor = _split_lr("muon_apply", lr, lists)
    _call("muon_apply", _ops.muon_apply, {}, lists, lr=lr_value, lr_tensor=lr_tensor, weight_decay=float(weight_decay),
          lr_scale=str(lr_scale), rows=rows, cols=cols, found_inf=found_inf)


def _register_sharded_fakes() -> None:
    """Fake kernels of the split-matrix ops (csrc/sharded_polar_ops.cpp): they only write their declared
    outputs, so tracing needs nothing from them."""
    for name in ("sharded_polar_norms", "sharded_polar_scale", "sharded_polar_gram", "sharded_polar_iterate",
                 "sharded_normuon_partial", "sharded_normuon_finish"):
        torch.library.register_fake(f"muon_ext::{name}")(lambda *args, **kwargs: None)


_register_sharded_fakes()


def sharded_polar_norms(x: torch.Tensor, sum_squares: torch.Tensor) -> None:
    """Split-matrix Polar-Express (docs/design.md, "Split matrices orthogonalized in place"), before the first
    sum over the shards' group: each matrix's sum of squares of this rank's shards `x` ([n, rows, cols] FP32)
    into `sum_squares` (float64, n entries)."""
    _ops.sharded_polar_norms(x, sum_squares)


def sharded_polar_scale(x: torch.Tensor, sum_squares: torch.Tensor, *, polar_dtype: str) -> None:
    """The shards `x` scaled by their whole matrices' input scale (from `sum_squares` summed over the group) and
    rounded to `polar_dtype`, in place."""
    _ops.sharded_polar_scale(x, sum_squares, polar_dtype=str(polar_dtype))


def sharded_polar_gram(x: torch.Tensor, gram: torch.Tensor, *, shard_dim: int, polar_dtype: str) -> None:
    """This rank's part of each matrix's Gram matrix into `gram` (FP32, n x side x side entries): X_r X_r^T where
    the shards split the columns (`shard_dim` 1), X_r^T X_r where they split the rows (0)."""
    _ops.sharded_polar_gram(x, gram, shard_dim=int(shard_dim), polar_dtype=str(polar_dtype))


def sharded_polar_iterate(x: torch.Tensor, gram: torch.Tensor, coefficients: Sequence[float], *, shard_dim: int,
                          polar_dtype: str) -> None:
    """One Polar-Express iteration (a, b, c) = `coefficients` on the shards `x`, in place, with the Gram
    matrices `gram` summed over the group."""
    a, b, c = (float(v) for v in coefficients)
    _ops.sharded_polar_iterate(x, gram, a=a, b=b, c=c, shard_dim=int(shard_dim), polar_dtype=str(polar_dtype))


def sharded_normuon_partial(x: torch.Tensor, stats: torch.Tensor, payload: torch.Tensor, *, rows: int, cols: int,
                            shard_dim: int, held: Optional[torch.Tensor], beta2: float, stats_local: bool) -> None:
    """NorMuon on the shard `x` of a `rows` x `cols` matrix, before the sum over the group: writes `payload`
    (float64, `sharded_normuon_payload_numel` entries); `stats` kept locally (`stats_local`) move here."""
    _ops.sharded_normuon_partial(x, stats, payload, rows=int(rows), cols=int(cols), shard_dim=int(shard_dim),
                                 held=held, beta2=float(beta2), stats_local=bool(stats_local))


def sharded_normuon_finish(x: torch.Tensor, stats: torch.Tensor, payload: torch.Tensor, *, rows: int, cols: int,
                           shard_dim: int, held: Optional[torch.Tensor], beta2: float, stats_local: bool) -> None:
    """NorMuon after the sum: the statistics and the shard's multipliers from the summed `payload`, in place."""
    _ops.sharded_normuon_finish(x, stats, payload, rows=int(rows), cols=int(cols), shard_dim=int(shard_dim),
                                held=held, beta2=float(beta2), stats_local=bool(stats_local))


def sharded_normuon_payload_numel(x: torch.Tensor, rows: int, cols: int, shard_dim: int, stats_local: bool) -> int:
    """Entries of `sharded_normuon_partial`'s payload: the shard's partial sums per held row (column) where the
    reduced dim is split, the two norm sums where the statistics are kept locally, else the whole statistics."""
    stat_dim = 0 if _C.stats_per_row(rows, cols) else 1
    if stat_dim != shard_dim:
        return x.shape[stat_dim]
    return 2 if stats_local else (rows if stat_dim == 0 else cols)


def split_master(
    master: torch.Tensor, param: Optional[torch.Tensor] = None, remainder: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split FP32 masters into (BF16 param, int16 remainder), TransformerEngine's
    convention (round half up on the bit pattern; exact round trip).

    Writes into `param` / `remainder` when given (contiguous, same shape and
    device as `master`), else into new tensors; returns both.
    """
    _require_tensor("split_master", "master", master)
    param = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device) if param is None else param
    remainder = torch.empty(master.shape, dtype=torch.int16, device=master.device) if remainder is None else remainder
    _require_tensor("split_master", "param", param)
    _require_tensor("split_master", "remainder", remainder)
    _ops.split_master(master, param, remainder)
    return param, remainder


def merge_master(param: torch.Tensor, remainder: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The exact FP32 masters held by BF16 params and int16 remainders."""
    _require_tensor("merge_master", "param", param)
    _require_tensor("merge_master", "remainder", remainder)
    out = torch.empty(param.shape, dtype=torch.float32, device=param.device) if out is None else out
    _require_tensor("merge_master", "out", out)
    _ops.merge_master(param, remainder, out)
    return out


def _optional_int(value, name):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    return value


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _entry(name: str, first: torch.Tensor, checked):
    """(callable, extra settings) for step op `name`: torch.ops.muon_ext.<name>,
    or for a plain eager call (no compile, no dispatch mode, no tensor subclass)
    its pybind twin in `_C`, which runs the same checks and kernels without the
    ~70 ns per list entry of a torch.ops call's generic argument conversion and
    takes the step check's token (csrc/ops.h; docs/design.md, "Ops (torch.library)")."""
    if (type(first) in _PLAIN_TENSOR_TYPES and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0):
        return getattr(_C, name), {"checked": checked}
    return getattr(_ops, name), {}


def _lists(op: str, **arguments) -> dict:
    """The Tensor[] arguments of a call as lists, by name, in the op's order."""
    lists = {}
    for name, seq in arguments.items():
        if isinstance(seq, torch.Tensor):  # list() would split it into rows
            raise TypeError(f"{op}: {name} must be a sequence of tensors, got a tensor of shape {tuple(seq.shape)}")
        lists[name] = list(seq)
    return lists


def _require_tensor(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    return value


_OPTIONAL_TENSORS = ("inv_scale", "found_inf")


def _call(op: str, fn, extra: dict, lists: dict, **settings) -> None:
    """fn(*lists, **settings, **extra). Where it fails because an argument or list
    entry is not a tensor, the error was pybind's or the dispatcher's generic
    conversion error (a signature dump), so raise one naming the op, argument
    and index instead. Looking only after a failure costs the common path
    nothing."""
    try:
        fn(*lists.values(), **settings, **extra)
    except (TypeError, RuntimeError):
        for name, entries in lists.items():
            for i, value in enumerate(entries):
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{op}: {name}[{i}] must be a tensor, got {type(value).__name__}") from None
        for name in _OPTIONAL_TENSORS:
            value = settings.get(name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{op}: {name} must be a tensor or None, got {type(value).__name__}") from None
        raise


def polar_method_for(polar_method: str, rows: int, cols: int) -> str:
    """The iteration, "standard" or "gram", that a rows x cols matrix runs
    under `polar_method` on every device: "auto" takes Gram where the long side
    is at least 4x the short one and the short side at least 512 (the rule of
    csrc/common/polar_plan.h, measured in bench/RESULTS.md)."""
    return _C.polar_method_for(str(polar_method), int(rows), int(cols))


def cpu_bf16_gemm() -> str:
    """How `polar_dtype="bfloat16"` multiplies on this CPU, decided once per
    process: "native" (the CPU has a BF16 GEMM, AVX-512 BF16 or AMX: oneDNN on
    BF16 buffers) or "rounded" (FP32 GEMMs on BF16 values, each output rounded
    to BF16: the same rounding points). MUON_EXT_CPU_BF16_GEMM=native|rounded
    forces one."""
    return _C.cpu_bf16_gemm()


def cpu_bf16_tile_gemm() -> str:
    """The instruction set on which the "native" path runs its GEMMs through
    oneDNN's batch-reduce micro-kernel, or "" where it does not: "amx"
    (AMX-BF16) or "avx512_bf16" (AVX-512 BF16 without AMX, e.g. Zen 4); tiles
    of 64 columns into an FP32 accumulator, each output rounded to BF16 once,
    for matrices whose sides are multiples of 16 (others take at::addmm). The
    two sum in different orders, so their bits differ. MUON_EXT_CPU_TILE_GEMM=0
    turns it off, unset or "1" leaves it on, anything else raises (read at
    every call, checked before a step writes anything); so does
    torch.backends.mkldnn.enabled = False."""
    return _C.cpu_bf16_tile_gemm()


def storage_problem(t: torch.Tensor) -> str:
    """What is wrong with `t`'s storage for its view, or '' when it holds every
    element: a storage released (untyped_storage().resize_(0)) or shrunk under
    a view would be read out of bounds. Every op refuses such tensors."""
    return _C.storage_problem(t)


def _has_work(op: str, main, base: str = "params", optional=("masters",), **lists) -> bool:
    """False for a call with an empty main list (no op runs: the dispatcher needs a
    tensor), after checking that the other lists are empty too."""
    if len(main) != 0:
        return True
    for name, value in lists.items():
        if len(value) != 0:
            if name in optional:
                raise ValueError(f"{op}: {name} must be empty or have one entry per param, got {len(value)} "
                                 f"for 0 params")
            raise ValueError(f"{op}: {name} has {len(value)} entries but {base} has 0")
    return False


def _flat_coefficients(op: str, coefficients, ns_steps) -> List[float]:
    """The (a, b, c) triples as the op's flat float list; each must be a triple."""
    coefficients = POLAR_EXPRESS_COEFFICIENTS if coefficients is None else coefficients
    flat = []
    for i, abc in enumerate(coefficients):
        abc = tuple(abc)
        if len(abc) != 3:
            raise ValueError(f"{op}: ns_coefficients[{i}] must be an (a, b, c) triple, got {len(abc)} values")
        flat.extend(float(v) for v in abc)
    return flat


def _split_lr(op: str, lr, lists: dict):
    """A host float, or a device tensor the kernel reads (a CPU tensor for device params is read here)."""
    if not isinstance(lr, torch.Tensor):
        return float(lr), None
    main = next(iter(lists))
    first = _require_tensor(op, f"{main}[0]", lists[main][0])
    if lr.device == first.device:
        return 0.0, lr  # the op checks it
    problem = _C.storage_problem(lr)
    if problem:
        raise ValueError(f"{op}: lr: {problem}")
    if lr.device.type == "cpu":
        return float(lr.item()), None
    raise ValueError(f"{op}: lr is on {lr.device} but {main} are on {first.device}")


def cpu_capabilities() -> list:
    """Instruction sets of the CPU kernels usable on this machine, best (used) last."""
    return list(_C.cpu_capabilities())
