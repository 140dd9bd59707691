"""QK-clip for MuonAdamW masters (docs/design.md, "Megatron-Core adapter").

Megatron's `clip_qk()` rescales `linear_qkv.weight.main_param` and `.data`.
With remainder masters there is no main param, so a clip written that way
would be undone at the next step; and in megatron-core 0.16.1 its reshape uses
the global projection sizes with the local number of query groups, which is
wrong at TP > 1. Here: Megatron's math per query group (q rows times
eta^alpha, k rows times eta^(1 - alpha)) on each rank's local rows of the FP32
master, read and written where they live (`get_local_master`,
`update_local_masters`: remainders, writers, offload and DTensor views all
follow), with no collective over the TP group: each TP rank scales its own
heads' rows, whatever the other ranks' logits.

eta = threshold / max logit where the group's max logit exceeds the
threshold (> 0), else 1: a group at or below it (negative and zero logits
included) is never scaled, and a clip never grows a weight. Every layer is
checked and computed before any is written; a refusal on any rank (missing,
misshapen or non-finite logits, a bad threshold, a master that cannot be read
or written) raises on every rank with nothing written and the logits kept, so
the call can be retried.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch

from ..distributed.agreement import refuse_together

__all__ = ["clip_qk"]


@torch.no_grad()
def clip_qk(model_chunks, optimizer, log_max_only: bool = False) -> float:
    """Clips every attention layer's QK projections whose max attention logit
    (all-reduced by MAX over the data-parallel group, as Megatron does) exceeds
    `config.qk_clip_threshold`; returns the largest logit. Collective: every
    rank calls it after the step, in the same order (one MAX all_reduce per
    layer over the data-parallel group, two one-integer all_reduces over the
    world, whatever the logits)."""
    from megatron.core import parallel_state

    layers = [(name, m) for chunk in model_chunks for name, m in chunk.named_modules()
              if hasattr(m, "linear_qkv") and hasattr(m, "core_attention") and hasattr(m, "clip_qk")]
    world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
    data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
    problems: List[str] = []
    reduced = []
    for name, attention in layers:
        # A missing or misshapen tensor is refused below, on every rank; its place in the reduction is kept.
        logits, problem = _logits_of(name, attention)
        if problem:
            problems.append(problem)
        torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX, group=data_parallel)
        reduced.append(logits)

    def plan() -> Tuple[float, list, list]:
        if problems:
            raise ValueError(f"muon_ext.megatron.clip_qk: {problems[0]}")
        largest, params, values = 0.0, [], []
        for (name, attention), logits in zip(layers, reduced):
            if not bool(torch.isfinite(logits).all()):
                raise ValueError(f"muon_ext.megatron.clip_qk: {name}: the max attention logits hold NaN or inf "
                                 f"({logits.tolist()}); nothing was clipped")
            largest = max(largest, float(logits.max()))
            if not log_max_only:
                clipped = _clipped_master(name, attention, logits, optimizer)
                if clipped is not None:
                    params.append(optimizer.view_of(attention.linear_qkv.weight))
                    values.append(clipped)
        return largest, params, values

    largest, params, values = refuse_together(world, plan, "muon_ext.megatron.clip_qk")
    optimizer.optimizer.update_local_masters(params, values, process_group=world)
    for _, attention in layers:  # consumed only now: a refused call leaves them for a retry
        attention.core_attention.current_max_attn_logits = None
    return largest


def _logits_of(name: str, attention):
    """(the layer's max logits per local head, a problem or ""): a zero tensor of the expected shape in place
    of a missing or misshapen one, so that the data-parallel reduction still matches every other rank's."""
    heads = attention.num_attention_heads_per_partition
    logits = attention.core_attention.current_max_attn_logits
    if logits is None:
        return torch.zeros(heads, device=attention.linear_qkv.weight.device), (
            f"{name} has no current_max_attn_logits (set TransformerConfig.qk_clip=True and run a forward first)")
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (heads,):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        return torch.zeros(heads, device=attention.linear_qkv.weight.device), (
            f"{name}: current_max_attn_logits has shape {shape}, expected ({heads},) (one per local head)")
    return logits, ""


def _clipped_master(name: str, attention, logits: torch.Tensor, optimizer):
    """This rank's clipped FP32 master rows of the layer's fused QKV weight, or None where no local query
    group exceeds the threshold (nothing to write). Reads the local master only."""
    config = attention.config
    threshold, alpha = config.qk_clip_threshold, config.qk_clip_alpha
    if not (isinstance(threshold, (int, float)) and 0 < threshold < math.inf):
        raise ValueError(f"muon_ext.megatron.clip_qk: qk_clip_threshold must be a positive finite number, got "
                         f"{threshold!r}")
    if not (isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        raise ValueError(f"muon_ext.megatron.clip_qk: qk_clip_alpha must be in [0, 1], got {alpha!r}")
    groups = attention.num_query_groups_per_partition
    grouped = logits.float().view(groups, -1).max(dim=1).values
    over = grouped > threshold
    if not bool(over.any()):
        return None
    # Only groups above the (positive) threshold: eta in (0, 1); every other group keeps eta = 1.
    eta = torch.where(over, threshold / torch.where(over, grouped, 1.0), 1.0).view(groups, 1, 1)
    master = optimizer.optimizer.get_local_master(optimizer.view_of(attention.linear_qkv.weight))
    heads_per_group = attention.num_attention_heads_per_partition // groups
    q_rows, kv_rows = heads_per_group * config.kv_channels, config.kv_channels
    per_group = master.view(groups, q_rows + 2 * kv_rows, -1)
    per_group[:, :q_rows].mul_(eta.to(master.device) ** alpha)
    per_group[:, q_rows:q_rows + kv_rows].mul_(eta.to(master.device) ** (1 - alpha))
    return master
