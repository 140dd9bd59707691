"""MuonAdamW under Hugging Face transformers' `Trainer` (transformers and
accelerate: `pip install 'muon_ext[hf]'`).

Three ways in, all building the same groups (`param_groups`):

* `MuonTrainer(model=..., args=..., muon_options={...})`: a `Trainer` whose
  `create_optimizer` builds MuonAdamW (works where `Trainer` refuses a ready
  optimizer, e.g. under its FSDP: the optimizer is made after wrapping);
* `Trainer(..., optimizers=(create_optimizer(model, args), None))`;
* `Trainer(..., optimizer_cls_and_kwargs=(MuonAdamWFactory, {...}))`: the
  factory form of transformers 5 (called with the model to optimize).

Groups: hidden matrices to Muon; the input embeddings, the output embeddings
(`lm_head`; once where tied to the input embeddings), every nn.Embedding,
norms, biases and MoE routers (`ROUTER_PATTERNS`) to AdamW. Trainer's
checkpoints save `optimizer.state_dict()` and resume it exactly
(tests/python/test_hf.py).
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional

import torch

try:
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("muon_ext.hf needs transformers and accelerate: pip install 'muon_ext[hf]'") from exc

from .grouping import param_groups as generic_param_groups
from . import MuonAdamW  # the public name: only __init__ imports optimizer.py

__all__ = ["ROUTER_PATTERNS", "param_groups", "create_optimizer", "MuonAdamWFactory", "MuonTrainer"]

# MoE routers (Mixtral / Qwen-MoE `mlp.gate`, `block_sparse_moe.gate`, `router`): a [experts, hidden] matrix
# that scores experts for a softmax / top-k, a small classifier head rather than a hidden layer; Muon's
# orthogonalized update would give every expert score the same scale.
ROUTER_PATTERNS = (r"(^|\.)(router|block_sparse_moe\.gate|mlp\.gate)(\.weight)?$",)

_OPTIMIZER_OPTIONS = ("master_weights", "store_param_remainders", "grad_attr", "capturable", "max_workspace_bytes",
                      "offload", "offload_config", "adapters")


def param_groups(model: torch.nn.Module, *, lr: Optional[float] = None, adamw_lr: Optional[float] = None,
                 weight_decay: float = 0.1, adamw_weight_decay: float = 0.0, adamw_patterns: Iterable[str] = (),
                 muon_patterns: Iterable[str] = (), adamw_betas=(0.9, 0.999), adamw_eps: float = 1e-8,
                 **muon_options) -> List[dict]:
    """MuonAdamW groups for a transformers model: `muon_ext.param_groups`
    plus the model's own input and output embeddings (`get_input_embeddings`,
    `get_output_embeddings`, whatever their names) and MoE routers to AdamW.
    Each param appears once (tied weights included); groups carry
    `param_names`. Learning rates as `muon_ext.param_groups` (one lr for both
    kinds unless both `lr` and `adamw_lr` are given; docs/guide.md, "One
    learning rate"). `muon_options` (momentum, beta2, ns_steps, lr_scale, ...)
    go into the Muon group, `adamw_betas` / `adamw_eps` into the AdamW group."""
    named = {id(p): name for name, p in model.named_parameters()}
    exact = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = _call(model, getter)
        if module is not None:
            exact += [r"^" + re.escape(named[id(p)]) + r"$" for p in module.parameters() if id(p) in named]
    groups = generic_param_groups(model, lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay,
                                  adamw_weight_decay=adamw_weight_decay,
                                  adamw_patterns=list(exact) + list(ROUTER_PATTERNS) + list(adamw_patterns),
                                  muon_patterns=muon_patterns, **muon_options)
    for group in groups:
        if group["kind"] == "adamw":
            group.update(betas=tuple(adamw_betas), eps=adamw_eps)
    return groups


def create_optimizer(model: torch.nn.Module, args: Optional["transformers.TrainingArguments"] = None, *,
                     lr: Optional[float] = None, weight_decay: Optional[float] = None, **options) -> MuonAdamW:
    """MuonAdamW for `model`, its AdamW group taking `args`' learning_rate,
    weight_decay, adam_beta1/2 and adam_epsilon (TrainingArguments).

    One learning rate by default (docs/guide.md, "One learning rate"): the
    Muon group takes the same learning_rate and weight_decay, its updates
    scaled to AdamW's update RMS (`lr_scale="match_rms_adamw"`), so the
    recipe's `TrainingArguments` serve both kinds. Given `lr`, the Muon group
    takes it on Muon's own scale instead (the two-lr form, `lr_scale`
    "original", weight decay `weight_decay` or 0.1), as before this default.
    `options`: `param_groups` keywords and MuonAdamW's (master_weights,
    offload, ...)."""
    optimizer_options = {k: options.pop(k) for k in _OPTIMIZER_OPTIONS if k in options}
    if args is not None:
        options.setdefault("adamw_lr", args.learning_rate)
        options.setdefault("adamw_weight_decay", args.weight_decay)
        options.setdefault("adamw_betas", (args.adam_beta1, args.adam_beta2))
        options.setdefault("adamw_eps", args.adam_epsilon)
    two_lrs = lr is not None and options.get("adamw_lr") is not None
    if weight_decay is None:  # one lr: the recipe's decay serves both kinds too
        weight_decay = 0.1 if two_lrs else options.get("adamw_weight_decay", 0.1)
    return MuonAdamW(param_groups(model, lr=lr, weight_decay=weight_decay, **options), **optimizer_options)


class MuonAdamWFactory:
    """For `Trainer(optimizer_cls_and_kwargs=(MuonAdamWFactory, kwargs))`:
    transformers calls `MuonAdamWFactory()(model, **kwargs)`; kwargs are
    `create_optimizer`'s (without TrainingArguments: give `adamw_lr` etc.)."""

    def __call__(self, model: torch.nn.Module, **kwargs) -> MuonAdamW:
        return create_optimizer(model, None, **kwargs)


class MuonTrainer(transformers.Trainer):
    """A `Trainer` that trains with MuonAdamW (`create_optimizer(model, args,
    **muon_options)`: by default TrainingArguments' learning_rate and
    weight_decay serve both kinds); everything else, schedulers and
    checkpoints included, is Trainer's."""

    def __init__(self, *args, muon_options: Optional[dict] = None, **kwargs):
        self.muon_options = dict(muon_options or {})
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = create_optimizer(self.model if model is None else model, self.args, **self.muon_options)
        return self.optimizer


def _call(model, getter: str):
    fn = getattr(model, getter, None)
    if fn is None:
        return None
    try:
        return fn()
    except NotImplementedError:  # models without that embedding
        return None
