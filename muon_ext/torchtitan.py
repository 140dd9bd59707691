"""MuonAdamW in torchtitan (`pip install 'muon_ext[titan]'`, torchtitan 0.3.0).

torchtitan builds optimizers from `OptimizersContainer.Config`: param groups
by FQN regex (`ParamGroupConfig`, first match wins), each naming an
optimizer; the container knows "Adam", "AdamW" and "DistMuon" only.
`MuonAdamWContainer` also knows "MuonAdamW", and `muon_adamw()` gives the
config, as torchtitan's `default_adamw()` does::

    from muon_ext.torchtitan import muon_adamw

    def llama3_debugmodel_muon():
        config = llama3_debugmodel()
        config.optimizer = muon_adamw(lr=8e-4)   # the recipe's AdamW lr serves both kinds
        return config

Groups (`LLAMA_GROUPS`, first match wins): embeddings, the output head,
norms, biases and MoE routers (`router.gate`) to AdamW; the other weights of
the transformer layers to Muon: attention, dense FFNs, shared experts, and
the routed experts' stacks (`w1_EFD`, `w2_EDF`, `w3_EFD`: `[E, out, in]`)
under `matrix_view="batch"`, each expert its own matrix, also when FSDP or
expert parallelism splits the stack (docs/design.md, "Expert stacks");
anything else to AdamW. torchtitan's MoE load balancing (the optimizer
step pre-hook that moves `expert_bias_E`, registered by the model's
`post_optimizer_build_fn`) runs on the container as with its own optimizers. Every group keeps torchtitan's
`param_names` (its checkpointer keys state by FQN) and `fused` / `foreach`
are accepted (MuonAdamW has one implementation). torchtitan's checkpointer
saves and resumes the container (tests/python/test_torchtitan.py). DTensor
params of every layout torchtitan makes (FSDP, TP, FSDP x TP) are
MuonAdamW's own business (muon_ext/distributed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

try:
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("muon_ext.torchtitan needs torchtitan: pip install 'muon_ext[titan]'") from exc

from . import MuonAdamW  # the public name: only __init__ imports optimizer.py
from .grouping import resolve_lrs

__all__ = ["OPTIMIZER_NAME", "LLAMA_GROUPS", "DEFAULT_LR", "MuonAdamWContainer", "build_muon_adamw", "muon_adamw"]

OPTIMIZER_NAME = "MuonAdamW"
DEFAULT_LR = 8e-4  # torchtitan's default_adamw() lr: the one lr of muon_adamw() when none is given

# (FQN pattern, kind), first match wins; written for torchtitan's llama3 / qwen3 / deepseek_v3 names.
# Routers ([experts, dim]) score experts for a top-k: a small classifier head, not a hidden layer.
LLAMA_GROUPS: Tuple[Tuple[str, str], ...] = (
    (r"(^|\.)(tok_embeddings|embed_tokens|embeddings?)\.", "adamw"),
    (r"^(output|lm_head)\.", "adamw"),
    (r"norm", "adamw"),
    (r"\.bias$", "adamw"),
    (r"(^|\.)(router|gate)\.", "adamw"),
    (r"^layers\.\d+\..*(weight|w[123](_[A-Z]+)?)$", "muon"),  # w1_EFD: 0.3.0's routed experts [E, F, D]
    (r".*", "adamw"),
)

_MUON_DEFAULTS = {"matrix_view": "batch"}  # grouped experts [E, out, in]: E matrices


def build_muon_adamw(param_groups: List[Dict[str, Any]], **options) -> MuonAdamW:
    """torchtitan's optimizer factory for "MuonAdamW": its param groups (each
    with `params`, `param_names`, `fused`, `foreach` and the
    `ParamGroupConfig.optimizer_kwargs`, which must name the `kind`) into
    one MuonAdamW; `options` (the config's
    `optimizer_factory_kwargs_by_name["MuonAdamW"]`) are MuonAdamW's
    (master_weights, offload, ...)."""
    groups = []
    for index, group in enumerate(param_groups):
        group = dict(group)
        for flag in ("fused", "foreach"):  # torchtitan adds both to every group
            value = group.pop(flag, None)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"MuonAdamW param group {index}: {flag} must be a bool, got {value!r}")
        if group.get("kind") not in ("muon", "adamw"):
            raise ValueError(f"MuonAdamW param group {index} ({len(group.get('params', []))} params, first "
                             f"{(group.get('param_names') or ['?'])[0]!r}): optimizer_kwargs must set kind='muon' or "
                             f"kind='adamw', got {group.get('kind')!r}")
        groups.append(group)
    return MuonAdamW(groups, **options)


class MuonAdamWContainer(OptimizersContainer):
    """torchtitan's OptimizersContainer that also resolves "MuonAdamW" (any
    other name resolves as in torchtitan). Build it from
    `MuonAdamWContainer.Config` (or `muon_adamw()`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @classmethod
    def _resolve_optimizer_factory(cls, name: str):
        if name == OPTIMIZER_NAME:
            return build_muon_adamw
        return super()._resolve_optimizer_factory(name)

    @classmethod
    def _build_param_groups(cls, model, param_group_configs, impl_kwargs):
        """torchtitan's grouping, after dropping the MuonAdamW patterns that
        would claim no param of this model part (torchtitan raises for those),
        so that one config (`LLAMA_GROUPS`: biases, routers) serves models
        with and without them, and pipeline stages without embeddings."""
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        claimed, used = set(), []
        for config in param_group_configs:
            pattern = re.compile(config.pattern)
            new = {n for n in names if n not in claimed and pattern.search(n)}
            claimed |= new
            if new or config.optimizer_name != OPTIMIZER_NAME:
                used.append(config)
        return super()._build_param_groups(model, used, impl_kwargs)


def muon_adamw(lr: Optional[float] = None, adamw_lr: Optional[float] = None, *, weight_decay: Optional[float] = None,
               adamw_weight_decay: float = 0.1, adamw_betas: Sequence[float] = (0.9, 0.95), adamw_eps: float = 1e-8,
               groups: Sequence[Tuple[str, str]] = LLAMA_GROUPS, muon_options: Dict[str, Any] = None,
               optimizer_options: Dict[str, Any] = None) -> MuonAdamWContainer.Config:
    """A `MuonAdamWContainer.Config`: one ParamGroupConfig per (pattern, kind)
    of `groups`, Muon ones with `lr`, `weight_decay` and `muon_options`
    (momentum, beta2, ns_steps, matrix_view, lr_scale, ...), AdamW ones with
    `adamw_*`; `optimizer_options` go to the MuonAdamW constructor.

    One learning rate by default (docs/guide.md, "One learning rate"): the lr
    given (`lr` or `adamw_lr`; torchtitan's AdamW default 8e-4 when neither
    is) and `adamw_weight_decay` serve both kinds, Muon updates scaled to
    AdamW's update RMS (`lr_scale="match_rms_adamw"`). Given both `lr` and
    `adamw_lr`, Muon takes `lr` on its own scale (`lr_scale` "original",
    `weight_decay` or 0.1), as before this default."""
    two_lrs = lr is not None and adamw_lr is not None
    muon_options = dict(muon_options or {})
    lr, adamw_lr, lr_scale = resolve_lrs(lr, adamw_lr, muon_options.pop("lr_scale", None), DEFAULT_LR)
    if weight_decay is None:
        weight_decay = 0.1 if two_lrs else adamw_weight_decay
    muon_kwargs = {"kind": "muon", "lr": lr, "weight_decay": weight_decay, **_MUON_DEFAULTS, **muon_options}
    if lr_scale is not None:
        muon_kwargs["lr_scale"] = lr_scale
    adamw_kwargs = {"kind": "adamw", "lr": adamw_lr, "weight_decay": adamw_weight_decay,
                    "betas": tuple(adamw_betas), "eps": adamw_eps}
    return MuonAdamWContainer.Config(
        param_groups=[ParamGroupConfig(pattern=pattern, optimizer_name=OPTIMIZER_NAME,
                                       optimizer_kwargs=dict(muon_kwargs if kind == "muon" else adamw_kwargs))
                      for pattern, kind in groups],
        optimizer_factory_kwargs_by_name={OPTIMIZER_NAME: dict(optimizer_options or {})})
