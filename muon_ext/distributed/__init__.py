"""DTensor params (FSDP2, HSDP, DDP-style replication) for MuonAdamW.

`placements`: accepted layouts and where each rank's rows are; `state`:
DTensor optimizer state and the update_param rule for DTensor values;
`exchange`: owner assignment and the all_to_all / all_gather of Muon
matrices; `step`: checks, the agreement collective and the step itself.
This file imports nothing, so that `schema` can import `placements` without
a cycle through `step`.
"""
