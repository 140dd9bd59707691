"""Splitting a model's parameters into Muon and AdamW groups."""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Tuple

import torch

__all__ = ["param_groups", "DEFAULT_LR", "ONE_LR_SCALE", "resolve_lrs"]

# The one learning rate when none is given (docs/guide.md, "One learning rate"): the AdamW lr
# param_groups has always defaulted to.
DEFAULT_LR = 3e-4
# The Muon group's lr_scale under one learning rate: updates scaled to AdamW's update RMS,
# lr * 0.2 * sqrt(max(rows, cols)) (docs/design.md, "Muon in three phases").
ONE_LR_SCALE = "match_rms_adamw"

# Names of input embeddings and output heads in common model code (GPT-2, Llama,
# Megatron, TransformerEngine): these matrices go to AdamW.
DEFAULT_ADAMW_NAME_PATTERNS = (
    r"(^|\.)(wte|wpe|embed_tokens|embed_positions|word_embeddings|position_embeddings|embedding|embeddings)(\.|$)",
    r"(^|\.)(lm_head|output_layer|head)(\.|$)",
)


def resolve_lrs(lr: Optional[float], adamw_lr: Optional[float], lr_scale: Optional[str],
                default_lr: float = DEFAULT_LR) -> Tuple[float, float, Optional[str]]:
    """(Muon lr, AdamW lr, Muon lr_scale or None for MuonAdamW's default) from
    what a caller gave (docs/guide.md, "One learning rate"). Both lrs given:
    the two-lr form, each group its own lr, lr_scale as given (None: the
    group's default, "original"). One or none given: that lr (or
    `default_lr`) serves both kinds, Muon updates scaled to AdamW's RMS
    (lr_scale "match_rms_adamw" unless given)."""
    if lr is not None and adamw_lr is not None:
        return lr, adamw_lr, lr_scale
    one = lr if lr is not None else adamw_lr if adamw_lr is not None else default_lr
    return one, one, lr_scale or ONE_LR_SCALE


def param_groups(
    model: torch.nn.Module,
    *,
    lr: Optional[float] = None,
    adamw_lr: Optional[float] = None,
    weight_decay: float = 0.1,
    adamw_weight_decay: float = 0.0,
    lr_scale: Optional[str] = None,
    adamw_patterns: Iterable[str] = (),
    muon_patterns: Iterable[str] = (),
    matrix_view: str = "flatten",
    **muon_options,
) -> List[dict]:
    """Param groups for MuonAdamW: every trainable param of rank >= 2 goes
    to Muon (any layer type, not only nn.Linear), except embeddings and the
    output head (nn.Embedding weights, params tied to them, and names matching
    the default embedding/head patterns); norms, biases and scalars go to AdamW.

    Learning rates (docs/guide.md, "One learning rate"): by default one lr
    serves both kinds, as in an AdamW recipe: `lr` (or `adamw_lr`, whichever
    is given; 3e-4 when neither is) for both groups, the Muon group with
    `lr_scale="match_rms_adamw"` (updates scaled to AdamW's update RMS).
    Given both `lr` and `adamw_lr`, each group takes its own (the two-lr form:
    Muon's lr on its own scale, `lr_scale` "original" unless given), as
    before this default existed. `weight_decay` goes to the Muon group,
    `adamw_weight_decay` to the AdamW group (embeddings, head, norms, biases).

    `adamw_patterns` / `muon_patterns` are regular expressions on parameter
    names that move params to AdamW / Muon (a Muon pattern wins over the
    defaults, an AdamW pattern over everything). Each group carries
    `param_names`. `muon_options` (momentum, beta2, ns_steps, ...) go into the
    Muon group.
    """
    lr, adamw_lr, lr_scale = resolve_lrs(lr, adamw_lr, lr_scale)
    if lr_scale is not None:
        muon_options["lr_scale"] = lr_scale
    adamw_res = [re.compile(p) for p in adamw_patterns]
    muon_res = [re.compile(p) for p in muon_patterns]
    default_res = [re.compile(p) for p in DEFAULT_ADAMW_NAME_PATTERNS]
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head_ids = _output_head_ids(model)

    muon, adamw = ([], []), ([], [])
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        target = _choose(name, p, embedding_ids | head_ids, default_res, muon_res, adamw_res)
        group = muon if target == "muon" else adamw
        group[0].append(p)
        group[1].append(name)

    groups = []
    if muon[0]:
        groups.append(dict(params=muon[0], param_names=muon[1], kind="muon", lr=lr, weight_decay=weight_decay,
                           matrix_view=matrix_view, **muon_options))
    if adamw[0]:
        groups.append(dict(params=adamw[0], param_names=adamw[1], kind="adamw", lr=adamw_lr,
                           weight_decay=adamw_weight_decay))
    return groups


def _choose(name, p, special_ids, default_res, muon_res, adamw_res) -> str:
    if any(r.search(name) for r in adamw_res):
        return "adamw"
    if p.dim() < 2:
        return "adamw"
    if any(r.search(name) for r in muon_res):
        return "muon"
    if id(p) in special_ids or any(r.search(name) for r in default_res):
        return "adamw"
    return "muon"


def _output_head_ids(model: torch.nn.Module) -> set:
    """The output head: the model's last nn.Linear, when its out_features is the
    largest embedding's size (the token vocabulary; tied or not). Only the last
    one, so a hidden layer that happens to be as wide as an embedding (an MLP of
    width 1024 beside a 1024-position embedding) stays on Muon. Heads of other
    layer types or positions are found by name."""
    vocab_sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not vocab_sizes or not linears or linears[-1].out_features != max(vocab_sizes):
        return set()
    return {id(linears[-1].weight)}
