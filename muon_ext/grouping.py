"""Splitting a model's parameters into Muon and AdamW groups."""

from __future__ import annotations

import re
from typing import Iterable, List

import torch

__all__ = ["param_groups"]

# Names of input embeddings and output heads in common model code (GPT-2, Llama,
# Megatron, TransformerEngine): these matrices go to AdamW.
DEFAULT_ADAMW_NAME_PATTERNS = (
    r"(^|\.)(wte|wpe|embed_tokens|embed_positions|word_embeddings|position_embeddings|embedding|embeddings)(\.|$)",
    r"(^|\.)(lm_head|output_layer|head)(\.|$)",
)


def param_groups(
    model: torch.nn.Module,
    *,
    lr: float = 0.02,
    adamw_lr: float = 3e-4,
    weight_decay: float = 0.1,
    adamw_weight_decay: float = 0.0,
    adamw_patterns: Iterable[str] = (),
    muon_patterns: Iterable[str] = (),
    matrix_view: str = "flatten",
    **muon_options,
) -> List[dict]:
    """Param groups for MuonAdamW: every trainable param of rank >= 2 goes
    to Muon (any layer type, not only nn.Linear), except embeddings and the
    output head (nn.Embedding weights, params tied to them, and names matching
    the default embedding/head patterns); norms, biases and scalars go to AdamW.

    `adamw_patterns` / `muon_patterns` are regular expressions on parameter
    names that move params to AdamW / Muon (a Muon pattern wins over the
    defaults, an AdamW pattern over everything). Each group carries
    `param_names`. `muon_options` (momentum, beta2, ns_steps, ...) go into the
    Muon group.
    """
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
