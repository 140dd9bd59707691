"""DTensor params (FSDP2, HSDP, DDP-style replication, tensor parallelism) for MuonAdamW.

`placements`: accepted layouts and where each rank's rows are; `stacks`: one
2-D view per matrix of a stack; `shard_group`: the ranks that hold each
matrix once and their process group; `state`: DTensor optimizer state and
the update_param rule for DTensor values; `exchange`: owner assignment and
the all_to_all / all_gather of Muon matrices; `tp_polar`: the collectives
of split matrices orthogonalized in place; `agreement`: cross-rank agreement
of settings and refusals; `ownership`: data-parallel ownership of plain
params; `step`: checks, the agreement collective and the DTensor params'
work items. This file imports nothing, so that `param_rules`
and `state` can import `placements` without a cycle through `step`.
"""
