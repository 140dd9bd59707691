"""QK-clip for MuonAdamW masters (docs/design.md, "Megatron-Core adapter").

Megatron's `clip_qk()` rescales `linear_qkv.weight.main_param` and `.data`.
With remainder masters there is no main param, so a clip written that way
would be undone at the next step; and in megatron-core 0.16.1 its reshape uses
the global projection sizes with the local number of query groups, which is
wrong at TP > 1. Here: Megatron's math (per query group, eta = min(1,
threshold / max logit); q rows times eta^alpha, k rows times eta^(1 - alpha))
on each rank's local rows of the FP32 master, written back with
`update_param` (remainders, writers, offload and DTensor views all follow).
"""

from __future__ import annotations

import torch

__all__ = ["clip_qk"]


@torch.no_grad()
def clip_qk(model_chunks, optimizer, log_max_only: bool = False) -> float:
    """Clips every attention layer's QK projections whose max attention logit
    (all-reduced by MAX over the data-parallel group, as Megatron does) exceeds
    `config.qk_clip_threshold`; returns the largest logit. Collective: every
    rank calls it after the step, in the same order."""
    from megatron.core import parallel_state

    largest = 0.0
    for chunk in model_chunks:
        for attention in chunk.modules():
            if not (hasattr(attention, "linear_qkv") and hasattr(attention, "core_attention")
                    and hasattr(attention, "clip_qk")):
                continue
            logits = attention.core_attention.current_max_attn_logits
            if logits is None:
                raise ValueError("muon_ext.megatron.clip_qk: an attention layer has no current_max_attn_logits "
                                 "(set TransformerConfig.qk_clip=True and run a forward first)")
            torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX,
                                         group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            largest = max(largest, logits.max().item())
            if not log_max_only:
                _clip_layer(attention, logits, optimizer)
            attention.core_attention.current_max_attn_logits = None
    return largest


def _clip_layer(attention, logits: torch.Tensor, optimizer) -> None:
    config = attention.config
    groups = attention.num_query_groups_per_partition
    grouped = logits.view(groups, -1).max(dim=1).values
    if not bool(torch.any(grouped > config.qk_clip_threshold)):
        return
    eta = torch.clamp(config.qk_clip_threshold / grouped, max=1.0).view(groups, 1, 1)
    weight = attention.linear_qkv.weight
    master = _local_master(optimizer, weight)
    heads_per_group = attention.num_attention_heads_per_partition // groups
    q_rows, kv_rows = heads_per_group * config.kv_channels, config.kv_channels
    per_group = master.view(groups, q_rows + 2 * kv_rows, -1)
    per_group[:, :q_rows].mul_(torch.pow(eta.repeat(1, q_rows, 1), config.qk_clip_alpha))
    per_group[:, q_rows:q_rows + kv_rows].mul_(torch.pow(eta, 1 - config.qk_clip_alpha))
    _write_local_master(optimizer, weight, master)


def _local_master(optimizer, weight) -> torch.Tensor:
    """This rank's FP32 master of the model param `weight` (a new tensor)."""
    from torch.distributed.tensor import DTensor

    held = optimizer.view_of(weight)
    if isinstance(held, DTensor):
        whole = optimizer.optimizer.gather_full_parameter_master(held)
        placement = held.placements[0]
        mesh = held.device_mesh
        return whole.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()].clone()
    return optimizer.optimizer.get_full_parameter_master(held)


def _write_local_master(optimizer, weight, master: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    held = optimizer.view_of(weight)
    if isinstance(held, DTensor):
        master = DTensor.from_local(master.contiguous(), held.device_mesh, held.placements, run_check=False,
                                    shape=held.shape, stride=held.stride())
    optimizer.optimizer.update_param(held, master)
