"""MegatronMuonAdamW: MuonAdamW behind Megatron-Core's MegatronOptimizer
interface, so that Megatron's training loop, OptimizerParamScheduler and
checkpointing drive it unchanged (docs/design.md, "Megatron-Core adapter").

It steps the DDP buffers' FP32 `main_grad` directly (grad_attr="main_grad"),
with BF16 params + int16 remainders as masters: no FP32 copy of the weights.
Gradients are unscaled (fp16), checked for inf/nan, clipped and their norm
reported over Megatron's groups, as Megatron's mixed-precision optimizer does.
Imports megatron-core at module level: `muon_ext.megatron` imports this module
only when it is used.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from .. import MuonAdamW, row_blocks
from ..distributed.placements import local
from . import config as cfg
from .params import MegatronParam, TensorParallelView

__all__ = ["MegatronMuonAdamW"]

class MegatronMuonAdamW(MegatronOptimizer):
    """Built by `muon_ext.megatron.get_megatron_muon_optimizer`.

    `param_groups` are Megatron's own groups (from its `_get_param_groups`:
    `wd_mult`, `lr_mult`, `max_lr`, `min_lr`, `is_expert_parallel`, ...),
    holding the model's params; the scheduler writes their `lr` and
    `weight_decay`. `optimizer` is the inner MuonAdamW, whose groups are
    derived from them at every step (Muon groups split by update scale)."""

    def __init__(self, config, megatron_groups: List[dict], params: Dict[int, MegatronParam], *, pg_collection,
                 grad_scaler=None, beta2=None, ns_coefficients=None, store_param_remainders: bool = True,
                 qkv_split_shapes=None, data_parallel_group=None):
        self.config = config
        for group in megatron_groups:  # what torch's constructor fills in before the scheduler's first step
            group.setdefault("lr", group.get("max_lr", config.lr))
            group.setdefault("weight_decay", config.weight_decay * group.get("wd_mult", 1.0))
        self._megatron_groups = megatron_groups
        self._params = params  # id(model param) -> MegatronParam
        self._views: Dict[int, TensorParallelView] = {}
        self._qkv_split_shapes = qkv_split_shapes
        self.pg_collection = pg_collection
        self.grad_scaler = grad_scaler
        self.is_stub_optimizer = False
        self.tp_mode = config.muon_tp_mode
        inner_groups = self._inner_groups(config, beta2, ns_coefficients)
        inner = MuonAdamW(inner_groups, grad_attr="main_grad", store_param_remainders=store_param_remainders,
                          adapters=False, data_parallel_group=data_parallel_group)
        super().__init__(inner, config)
        device = next(iter(params.values())).param.device if params else torch.device("cpu")
        self._scale_one = torch.tensor([1.0], dtype=torch.float, device=device)
        self.found_inf = torch.tensor([0.0], dtype=torch.float, device=device)

    # -- construction -------------------------------------------------------

    def _inner_groups(self, config, beta2, ns_coefficients) -> List[dict]:
        """One AdamW group per Megatron group, and one Muon group per (Megatron group, update factor); the
        fused QKV weight under muon_split_qkv in a Muon group of its own whose row_blocks are Megatron's Q, K
        and V matrices, each with its own update factor (row_block_scales)."""
        muon_settings = cfg.muon_settings(config, beta2, ns_coefficients)
        if self.tp_mode == "distributed":  # TP-split matrices orthogonalized in place by Gram all_reduces
            muon_settings["split_matrices"] = "in_place"
        adamw_settings = cfg.adamw_settings(config)
        inner = []
        for index, group in enumerate(self._megatron_groups):
            by_key: Dict[tuple, dict] = {}
            for p in group["params"]:
                mp = self._params[id(p)]
                tensor = self._inner_param(mp)
                blocks = {}
                if mp.kind == "adamw":
                    key, factor, settings = ("adamw",), 1.0, adamw_settings
                elif self._qkv_split_shapes is not None and _is_qkv(mp):
                    blocks = self._qkv_blocks(mp, config)
                    key, factor, settings = ("muon", 1.0, repr(blocks)), 1.0, muon_settings
                else:
                    rows, cols = self._muon_shape(mp)
                    factor = cfg.muon_scale(rows, cols, config.muon_scale_mode, config.muon_extra_scale_factor)
                    key, settings = ("muon", factor), muon_settings
                    if mp.grouped:  # a GroupedMLP weight: its experts' stack, each expert a matrix
                        key, settings = key + ("batch",), dict(muon_settings, matrix_view="batch")
                if key not in by_key:
                    by_key[key] = dict(kind=key[0], params=[], param_names=[], megatron_group=index,
                                       update_factor=factor, **settings, **blocks)
                by_key[key]["params"].append(tensor)
                by_key[key]["param_names"].append(mp.name)
            inner.extend(by_key.values())
        for group in inner:
            group["lr"], group["weight_decay"] = self._lr_and_decay(group)
        return inner

    def _qkv_blocks(self, mp: MegatronParam, config) -> dict:
        """Megatron's QKV split of the matrix Muon sees (the local shard in "blockwise" mode, else the whole
        weight): per query group q, k and v rows; one Q, one K and one V matrix gathered across the groups,
        each scaled by its own shape (muon_ext.row_blocks: index blocks and row_block_scales)."""
        rows, cols = self._muon_shape(mp)
        per_group = sum(self._qkv_split_shapes)
        if rows % per_group:
            raise ValueError(f"muon_ext.megatron: a linear_qkv weight of {rows} rows does not hold whole query "
                             f"groups of {per_group} rows ({tuple(self._qkv_split_shapes)})")
        groups = rows // per_group
        scales = tuple(cfg.muon_scale(groups * size, cols, config.muon_scale_mode, config.muon_extra_scale_factor)
                       for size in self._qkv_split_shapes)
        return dict(row_blocks=row_blocks.interleaved(groups, self._qkv_split_shapes), row_block_scales=scales)

    def _muon_shape(self, mp: MegatronParam):
        """(out, in) of the matrix Muon orthogonalizes: the local shard in "blockwise" mode, else the whole
        matrix (one expert's for a GroupedMLP weight)."""
        return mp.out_in(full=mp.partition_dim is not None and self.tp_mode != "blockwise")

    def _inner_param(self, mp: MegatronParam) -> torch.Tensor:
        """The tensor the inner MuonAdamW holds for a model param: the param itself, or for a TP-split Muon
        param outside "blockwise" mode its DTensor view (orthogonalized whole by the owner exchange,
        "duplicated", or in place by Gram all_reduces, "distributed"), and for a GroupedMLP weight its
        experts' stack (a DTensor where split so)."""
        split = mp.partition_dim is not None and self.tp_mode != "blockwise"
        if mp.kind == "muon" and (split or mp.grouped):
            view = TensorParallelView(mp, split=split)
            view.refresh_grad()
            self._views[id(mp.param)] = view
            return view.tensor
        return mp.param

    def _lr_and_decay(self, inner_group: dict):
        outer = self._megatron_groups[inner_group["megatron_group"]]
        return cfg.lr_and_decay(outer["lr"], outer["weight_decay"], inner_group["update_factor"])

    # -- Megatron's view ---------------------------------------------------

    def _get_param_groups(self):
        return self._megatron_groups

    def _set_param_groups(self, value):
        self._megatron_groups = value

    param_groups = property(_get_param_groups, _set_param_groups)

    def get_parameters(self) -> List[torch.nn.Parameter]:
        return [p for g in self._megatron_groups for p in g["params"]]

    def view_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor the inner MuonAdamW holds for a model param: the param, or its DTensor view."""
        view = self._views.get(id(param))
        return param if view is None else view.tensor

    # -- grads -------------------------------------------------------------

    def _main_grads(self, experts: Optional[bool] = None, for_norm: bool = False) -> List[torch.Tensor]:
        grads = []
        for p in self.get_parameters():
            mp = self._params[id(p)]
            if experts is not None and mp.expert != experts:
                continue
            grad = getattr(p, "main_grad", None)
            if grad is None:
                continue
            if for_norm and not (param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(
                    p, self.pg_collection.expt_tp if mp.expert else self.pg_collection.tp)):
                continue
            grads.append(grad)
        return grads

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return self._main_grads(for_norm=True)

    def _grad_stats_parts(self):
        """Megatron's split of the grad statistics (ChainedOptimizer: a dense and an expert optimizer, each reducing
        its own): (experts?, group): dense params over the model-parallel group, expert params over the expert
        tensor x expert x pipeline group, whose ranks hold other experts' grads or other parts of them."""
        parts = [(False, self.pg_collection.mp)]
        if any(mp.expert for mp in self._params.values()):
            parts.append((True, self.pg_collection.tp_ep_pp))
        return parts

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """Megatron's L2 norm of the main grads: dense and expert norms over their groups, combined as
        ChainedOptimizer does."""
        norms = [get_grad_norm_fp32(self._main_grads(experts=experts, for_norm=True), grad_stats_parallel_group=group)
                 for experts, group in self._grad_stats_parts()]
        return norms[0] if len(norms) == 1 else math.sqrt(sum(norm ** 2 for norm in norms))

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        clip_coeff = clip_grad / (grad_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(self._main_grads(), clip_coeff)
        return grad_norm

    @torch.no_grad()
    def count_zeros(self) -> float:
        total = 0.0
        for experts, group in self._grad_stats_parts():
            zeros = torch.zeros(1, dtype=torch.float, device=self._scale_one.device)
            for grad in self._main_grads(experts=experts, for_norm=True):
                zeros += grad.numel() - torch.count_nonzero(grad)
            torch.distributed.all_reduce(zeros, group=group)
            total += zeros.item()
        return total

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """fp16 (a grad scaler): unscale the main grads in place, find inf/nan over the grad-stats groups
        (dense and expert, as ChainedOptimizer), update the scale; returns whether the step must be skipped."""
        if self.grad_scaler is None:
            return False
        found_inf = False
        for experts, group in self._grad_stats_parts():
            self.found_inf.fill_(0.0)
            grads = self._main_grads(experts=experts)
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.grad_scaler.inv_scale)
            torch.distributed.all_reduce(self.found_inf, op=torch.distributed.ReduceOp.MAX, group=group)
            found_inf |= self.found_inf.item() > 0
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """The inner MuonAdamW step on the (unscaled, clipped) main grads, at the scheduler's lr / wd."""
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self._lr_and_decay(group)
        for view in self._views.values():
            view.refresh_grad()
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self):
        """Megatron's step contract: (update_successful, grad_norm, num_zeros_in_grad)."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = 0.0
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else 0
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True):
        """The model params' `.grad` (DDP's main_grad buffers are zeroed by the model's zero_grad_buffer)."""
        for p in self.get_parameters():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # -- masters and checkpoints -------------------------------------------

    @torch.no_grad()
    def reload_model_params(self, state_dict=None):
        """The params were changed outside the optimizer: each master becomes the param's value
        (remainders cleared). Collective for TP views (every rank of their TP group calls it)."""
        if state_dict is not None:
            raise ValueError("muon_ext.megatron: reload_model_params from a state dict is not supported; load the "
                             "optimizer's own state dict instead")
        for p in self.get_parameters():
            target = self.view_of(p)
            self.optimizer.update_param(target, target.detach().float(), allow_nonfinite=True)

    def state_dict(self):
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        """Loads `state_dict()` or what dist_checkpointing.load returned for
        `sharded_state_dict(..., is_loading=True)` (local shards, one common AdamW step)."""
        inner = self._with_steps(state_dict["optimizer"])
        # The inner groups are derived from Megatron's groups and the config (lr and weight decay at every
        # step), and their split by update scale depends on the TP size in "blockwise" mode: keep this run's.
        inner = dict(inner, param_groups=self.optimizer.state_dict()["param_groups"])
        if self._views:
            inner = self._as_views(inner)
        self.optimizer.load_state_dict(inner)
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _inner_params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _model_param_of(self) -> List[torch.nn.Parameter]:
        """The model param behind each inner param, in the inner state dict's order."""
        by_view = {id(v.tensor): v.source.param for v in self._views.values()}
        return [by_view.get(id(p), p) for p in self._inner_params()]

    def _as_views(self, inner: dict) -> dict:
        """A state dict holding plain local tensors (a dist_checkpointing load) with the
        tensors of views in their view's shape (a GroupedMLP weight's stack), wrapped as DTensors on
        their view's mesh where split."""
        from torch.distributed.tensor import DTensor, Replicate

        inner = dict(inner)
        inner["state"] = dict(inner["state"])
        for index, model_param in enumerate(self._model_param_of()):
            view = self._views.get(id(model_param))
            entry = inner["state"].get(index)
            if view is None or entry is None:
                continue
            wrapped = {}
            current = self.optimizer.state.get(view.tensor, {})
            for key, value in entry.items():
                plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                if plain and tuple(value.shape) == tuple(view.source.param.shape):  # param-shaped: the view's shape
                    value = value.reshape(view.source.view_shape(full=False))
                if plain and view.split:
                    like = current.get(key)
                    if isinstance(like, DTensor):  # placed as this run's entry (NorMuon statistics: rows or whole)
                        placements = like.placements
                    else:
                        same_shape = tuple(value.shape) == tuple(view.tensor.to_local().shape)
                        placements = view.placements if same_shape else (Replicate(),)
                        like = view.tensor if same_shape else value
                    value = DTensor.from_local(value.contiguous(), view.mesh, placements, run_check=False,
                                               shape=like.shape, stride=like.stride())
                wrapped[key] = value
            inner["state"][index] = wrapped
        return inner

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata: Optional[dict] = None):
        """Every param-shaped state tensor (moments, FP32 masters) as a ShardedTensor
        sharded like its model param, and NorMuon statistics as the whole matrix's
        (split by rows where they follow a row split), so that dist_checkpointing
        reshards them across TP sizes. AdamW step counters are saved once, as
        Megatron does ("common_step")."""
        state = self.state_dict()
        inner = state["optimizer"]
        models = self._model_param_of()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, models)
        common_step = None
        sharded = {}
        for index, entry in inner["state"].items():
            model_param = id_map[index]
            out = {}
            for key, value in entry.items():
                if key == "step":
                    common_step = local(value).clone() if common_step is None else common_step
                    continue
                mp = self._params[id(models[index])]
                if key == "second_momentum_buffer":
                    out[key] = self._statistics_tensor(model_param, value, mp)
                    continue
                out[key] = make_sharded_optimizer_tensor(model_param, local(value).reshape(mp.param.shape),
                                                         prefix=f"optimizer.state.{key}")
            sharded[index] = out
        if common_step is not None:
            sharded["common_step"] = common_step
        inner = dict(inner, state=sharded)
        return dict(state, optimizer=inner)

    def _statistics_tensor(self, model_param, value: torch.Tensor, mp: MegatronParam):
        """NorMuon statistics as a ShardedTensor under the model param's key and prepended (layer) axes: split
        over TP by rows where this rank holds only its rows' (a DTensor view split on dim 0 whose statistics
        follow the rows; "blockwise": each shard's own, at the same TP size only), else the whole statistics,
        one replica per TP group."""
        from megatron.core.dist_checkpointing import ShardedTensor
        from torch.distributed.tensor import DTensor, Shard

        if mp.grouped:
            raise ValueError(f"muon_ext.megatron: {mp.name}: NorMuon statistics of a GroupedMLP weight (per "
                             "expert) are not supported in dist_checkpointing (use beta2=None, or state_dict())")
        if not isinstance(model_param, ShardedTensor):
            raise ValueError(f"muon_ext.megatron: {mp.name}: NorMuon statistics of a param saved through a "
                             "ShardedTensorFactory are not supported in dist_checkpointing (use beta2=None)")
        data = local(value).contiguous()
        tp_rank = torch.distributed.get_rank(mp.tp_group) if mp.tp_group is not None else 0
        if isinstance(value, DTensor):
            by_rows = any(isinstance(pl, Shard) and pl.dim == 0 for pl in value.placements)
        else:
            by_rows = mp.partition_dim is not None
        n = model_param.prepend_axis_num
        replica = model_param.replica_id if isinstance(model_param.replica_id, tuple) else (model_param.replica_id,)
        rest = (0,) * (data.dim() - 1)
        if by_rows:
            shape = (data.shape[0] * mp.tp_size,) + tuple(data.shape[1:])
            offset, fragments = (data.shape[0] * tp_rank,) + rest, (mp.tp_size,) + (1,) * (data.dim() - 1)
        else:
            shape, offset, fragments = tuple(data.shape), (0,) + rest, (1,) * data.dim()
            replica = (tp_rank,) + replica
        sharded = ShardedTensor(
            key=f"optimizer.state.second_momentum_buffer.{model_param.key}", data=data, dtype=data.dtype,
            local_shape=tuple(data.shape), global_shape=tuple(model_param.global_shape[:n]) + shape,
            global_offset=tuple(model_param.global_offset[:n]) + offset,
            axis_fragmentations=tuple(model_param.axis_fragmentations[:n]) + fragments, replica_id=replica,
            prepend_axis_num=n)
        sharded.validate_metadata_integrity()
        return sharded

    def _with_steps(self, inner: dict) -> dict:
        """The per-param AdamW step counters back from a sharded checkpoint's "common_step"."""
        if "common_step" not in inner["state"]:
            return inner
        states = dict(inner["state"])
        step = states.pop("common_step")
        for index, entry in states.items():
            if self._inner_group_kind(index) == "adamw":
                states[index] = dict(entry, step=torch.as_tensor(step, dtype=torch.float32).clone())
        return dict(inner, state=states)

    def _inner_group_kind(self, index: int) -> str:
        count = 0
        for group in self.optimizer.param_groups:
            count += len(group["params"])
            if index < count:
                return group["kind"]
        raise IndexError(index)


def _is_qkv(mp: MegatronParam) -> bool:
    """Megatron's rule for the fused QKV weight (muon.py: is_qkv)."""
    return "linear_qkv.weight" in mp.name and mp.param.dim() == 2
