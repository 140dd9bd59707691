"""Megatron-Core integration: MuonAdamW as the Muon of Megatron-Core.

`get_megatron_muon_optimizer(config, model_chunks)` takes megatron-core's
signature and returns a `MegatronOptimizer` that Megatron's training loop
drives unchanged (see docs/megatron.md). megatron-core is imported only when
these functions are called (`pip install "muon_ext[megatron]"`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .config import MATCH_RMS_ADAMW, TP_MODES, check_config

__all__ = ["get_megatron_muon_optimizer", "clip_qk", "TP_MODES", "MATCH_RMS_ADAMW"]


def get_megatron_muon_optimizer(
    config,
    model_chunks: List,
    config_overrides: Optional[Dict] = None,
    use_gloo_process_groups: bool = True,
    layer_wise_distributed_optimizer: bool = False,
    pg_collection=None,
    *,
    beta2: Optional[float] = None,
    ns_coefficients=None,
    store_param_remainders: bool = True,
):
    """MuonAdamW for Megatron-Core model chunks, with megatron-core's signature and param rules.

    Muon takes 2-D params that are not embeddings or the output layer, AdamW
    the rest; groups (`wd_mult`, `lr_mult`, `is_expert_parallel`, overrides)
    come from Megatron's own grouping. Read from `config` (an OptimizerConfig):
    lr, min_lr, weight_decay, adam_beta1/2, adam_eps, clip_grad, bf16, fp16 with
    loss_scale / initial_loss_scale / min_loss_scale / loss_scale_window /
    hysteresis, log_num_zeros_in_grad, and muon_momentum, muon_use_nesterov,
    muon_scale_mode, muon_extra_scale_factor, muon_num_ns_steps, muon_tp_mode,
    muon_fp32_matmul_prec ("highest": FP32 Polar-Express, else BF16), muon_split_qkv
    (the fused QKV weight orthogonalized as one Q, one K and one V matrix, each
    gathered across the query groups, each with its own update scale).

    Beyond Megatron's arguments: `beta2` switches NorMuon on (None: plain Muon,
    as Megatron's), `ns_coefficients` replaces the Polar-Express tuples,
    `store_param_remainders=False` keeps FP32 master tensors instead of int16
    remainders. `use_gloo_process_groups` is accepted and unused (no gloo groups
    are needed). `layer_wise_distributed_optimizer=True` (Megatron's flag: DDP
    all-reduces the grads, each param is stepped by one data-parallel rank, the
    params are all-gathered after the step) runs the core's data-parallel
    ownership over the data-parallel (x context-parallel) group: each rank keeps
    the state of the params it owns (docs/megatron.md); for now at TP = 1 or in
    muon_tp_mode "blockwise", without expert params. `config.use_distributed_optimizer`
    is refused. Collective: every rank calls it.
    """
    check_config(config)
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    from megatron.core.process_groups_config import ProcessGroupCollection

    from .optimizer import MegatronMuonAdamW
    from .params import classify, grouped_experts

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    names = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            names.setdefault(id(p), name)
    groups = _get_param_groups(model_chunks, config, config_overrides)
    grouped = grouped_experts(model_chunks)  # legacy GroupedMLP weights: orthogonalized per expert
    params = {id(p): classify(p, names[id(p)], pg_collection, grouped.get(id(p), 0)) for g in groups
              for p in g["params"]}
    data_parallel_group = None
    if layer_wise_distributed_optimizer:
        if any(mp.expert for mp in params.values()):
            raise ValueError("muon_ext.megatron: layer_wise_distributed_optimizer=True with expert params is not "
                             "supported yet (they are replicated over the expert data-parallel group, not the "
                             "data-parallel one)")
        if config.muon_tp_mode != "blockwise" and any(mp.partition_dim is not None and mp.tp_size > 1
                                                      for mp in params.values()):
            raise ValueError("muon_ext.megatron: layer_wise_distributed_optimizer=True at TP > 1 needs "
                             "muon_tp_mode='blockwise' for now (the other modes step TP-split matrices as DTensor "
                             "views, which data-parallel ownership does not take yet)")
        data_parallel_group = pg_collection.dp_cp
    qkv_split_shapes = _qkv_split_shapes(model_chunks) if config.muon_split_qkv else None
    grad_scaler = None
    if config.loss_scale:
        grad_scaler = ConstantGradScaler(config.loss_scale)
    elif config.fp16:
        grad_scaler = DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                        growth_factor=2.0, backoff_factor=0.5,
                                        growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
    return MegatronMuonAdamW(config, groups, params, pg_collection=pg_collection, grad_scaler=grad_scaler,
                             beta2=beta2, ns_coefficients=ns_coefficients,
                             store_param_remainders=store_param_remainders, qkv_split_shapes=qkv_split_shapes,
                             data_parallel_group=data_parallel_group)


def clip_qk(model_chunks: List, optimizer, log_max_only: bool = False) -> float:
    """Megatron's QK-clip applied to the optimizer's FP32 masters (see muon_ext.megatron.qk_clip)."""
    from .qk_clip import clip_qk as clip

    return clip(model_chunks, optimizer, log_max_only)


def _qkv_split_shapes(model_chunks):
    """Rows of (q, k, v) per query group of the fused linear_qkv weight, as Megatron's Muon splits it."""
    shapes = set()
    for chunk in model_chunks:
        c = chunk.config
        if getattr(c, "attention_output_gate", False):
            raise ValueError("muon_ext.megatron: muon_split_qkv with attention_output_gate is not supported")
        groups = c.num_query_groups or c.num_attention_heads
        shapes.add((c.num_attention_heads // groups * c.kv_channels, c.kv_channels, c.kv_channels))
    if len(shapes) > 1:
        raise ValueError(f"muon_ext.megatron: model chunks disagree on the QKV split: {sorted(shapes)}")
    return shapes.pop() if shapes else None
