"""A scale model of MuonAdamW's data-parallel ownership, from the real planner
(muon_ext.distributed.ownership.assign_owners), without processes or a GPU.

For a model's shapes and a layout (PP x DP x TP, experts over EP), per rank:
optimizer-state bytes, Polar-Express FLOPs and their imbalance (max / mean
over the ranks that share the work), bytes sent per step; then a predicted
optimizer-step time on H100 / H200 and its fraction of the training step.

How work is shared (the model, stated):
  * non-expert matrices of a pipeline stage: held by the DP x TP ranks of the
    stage (TP shards, DP replicas); each whole matrix is orthogonalized by one
    owner among those DP x TP ranks (the TP owner exchange brings its rows,
    ownership picks the rank), by longest processing time first;
  * expert matrices: each EP rank holds E / EP experts of a layer, replicated
    over the expert-data-parallel ranks (DP x TP / EP); each expert matrix is
    owned by one of them;
  * AdamW params (embeddings, output head, norms, routers): owned by bytes over
    the stage's DP x TP ranks;
  * state per owned param: Muon 6 bytes (FP32 momentum + int16 remainder of a
    BF16 param), AdamW 10 bytes (two FP32 moments + int16 remainder); NorMuon's
    statistics (one FP32 per row) included. "Replicated" is the same optimizer
    without ownership: every rank keeps the state of every param it holds.
  * bytes sent per rank and step: the all_gather of the new BF16 params over
    the ownership group ((n-1)/n of the group's bytes per rank in a ring) and,
    for TP-split matrices, the owner exchange (FP32 rows to the owner and back:
    2 x 4 bytes x (TP-1)/TP of each such matrix, spread over the TP ranks).
  * time: Polar-Express at `--polar-tflops` (default 400 TFLOP/s: the one H200
    session measured the Muon kernels at 0.51-0.76 of the BF16 bmm rate, itself
    below the 989 TFLOP/s dense BF16 peak; an assumption, not a measurement of
    these shapes), the elementwise passes reading and writing the owned state,
    params and grads at 70% of HBM bandwidth (3.35 TB/s H100, 4.8 TB/s H200;
    the AdamW kernel measured 0.68-0.74 of a copy's rate on the H200), the
    param all_gather at `--link-gbps` per GPU (default 40 GB/s: 400 Gb/s
    InfiniBand) and exposed only with `--no-overlap` (Megatron's
    overlap_param_gather hides it behind the next forward), the TP owner
    exchange at `--nvlink-gbps` (default 450 GB/s, NVLink 4 one way) and
    always exposed. Training step:
    6 x active params x tokens per step / (GPUs x 989 TFLOP/s x MFU).

Usage: python bench/scale_plan.py [--out bench/results/scale_plan.json] [--mfu 0.4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, NamedTuple, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from muon_ext.distributed.ownership import assign_owners, imbalance, polar_flops  # noqa: E402

BF16_PEAK_TFLOPS = 989.0
HBM_TBPS = {"H100": 3.35, "H200": 4.8}
MUON_STATE_BYTES, ADAMW_STATE_BYTES = 6, 10


class Model(NamedTuple):
    name: str
    layers: int
    dense: List[Tuple[int, int]]  # non-expert Muon matrices per layer (rows, cols), unsharded
    experts: int  # routed experts per layer (0: a dense model)
    expert_matrices: List[Tuple[int, int]]  # per expert
    shared_experts: int
    adamw_params: int  # embeddings, output head, norms, routers
    active_params: float  # per token (6 N D training FLOPs)
    tokens_per_step: float
    moe_layers: int = 0  # layers with experts (the others use dense_mlp)
    dense_mlp: List[Tuple[int, int]] = []


def llama3(name, d, layers, kv, ffn, vocab, tokens):
    attn = [(d, d), (kv, d), (kv, d), (d, d)]
    mlp = [(ffn, d), (ffn, d), (d, ffn)]
    params = layers * sum(r * c for r, c in attn + mlp) + 2 * vocab * d
    return Model(name, layers, attn + mlp, 0, [], 0, 2 * vocab * d + (2 * layers + 1) * d, params, tokens)


def kimi_k2_like():
    """DeepSeek-V3's architecture at Kimi K2's published sizes: d 7168, 61 layers (1 dense), MLA with 64 heads,
    384 routed experts of 2048 plus 1 shared, vocab 163840; 67M tokens per step."""
    d, heads, vocab = 7168, 64, 163840
    attn = [(1536, d), (heads * 192, 1536), (576, d), (heads * 256, 512), (d, heads * 128)]
    expert = [(2048, d), (2048, d), (d, 2048)]
    dense_mlp = [(18432, d), (18432, d), (d, 18432)]
    layers, moe_layers, experts = 61, 60, 384
    active = (layers * sum(r * c for r, c in attn) + (layers - moe_layers) * sum(r * c for r, c in dense_mlp)
              + moe_layers * (8 + 1) * sum(r * c for r, c in expert) + 2 * vocab * d)
    adamw = 2 * vocab * d + moe_layers * experts * d + 4 * layers * d
    return Model("Kimi-K2-like MoE (1.0T)", layers, attn, experts, expert, 1, adamw, active, 67e6,
                 moe_layers=moe_layers, dense_mlp=dense_mlp)


def plan(model: Model, pp: int, dp: int, tp: int, ep: int, ns_steps: int = 5) -> Dict:
    """Per-rank figures of the busiest rank of one pipeline stage (stages are alike: layers / PP each)."""
    layers = model.layers / pp
    moe = model.moe_layers / pp
    dense_layers_mlp = (model.layers - model.moe_layers) / pp
    group = dp * tp  # the ranks of a stage
    # non-expert matrices: owners over the stage's DP x TP ranks (whole matrices)
    shapes = [s for _ in range(round(layers)) for s in model.dense]
    shapes += [s for _ in range(round(dense_layers_mlp)) for s in model.dense_mlp]
    shapes += [s for _ in range(round(moe)) for _ in range(model.shared_experts) for s in model.expert_matrices]
    costs = [float(polar_flops(r, c, ns_steps)) for r, c in shapes]
    loads = [0.0] * group
    owners = assign_owners(costs, loads)
    owned_elems = [0] * group
    for (r, c), o in zip(shapes, owners):
        owned_elems[o] += r * c
    dense_elems = sum(r * c for r, c in shapes)
    # expert matrices: each EP rank's experts, owned over the expert-data-parallel ranks
    expert_dp = max(1, group // ep)
    experts_here = model.experts // ep if model.experts else 0
    e_shapes = [s for _ in range(round(moe)) for _ in range(experts_here) for s in model.expert_matrices]
    e_loads = [0.0] * expert_dp
    e_owners = assign_owners([float(polar_flops(r, c, ns_steps)) for r, c in e_shapes], e_loads)
    e_owned = [0] * expert_dp
    for (r, c), o in zip(e_shapes, e_owners):
        e_owned[o] += r * c
    expert_elems_here = sum(r * c for r, c in e_shapes)
    adamw_elems = model.adamw_params / pp
    # the busiest rank: dense work of rank 0's share + its expert share (rank k of the stage is expert-DP rank
    # k % expert_dp of some EP rank; every EP rank sees the same expert shapes)
    flops = [loads[k] + e_loads[k % expert_dp] for k in range(group)]
    state = [MUON_STATE_BYTES * (owned_elems[k] + e_owned[k % expert_dp]) + ADAMW_STATE_BYTES * adamw_elems / group
             for k in range(group)]
    busiest = max(range(group), key=lambda k: flops[k])
    owned = [owned_elems[k] + e_owned[k % expert_dp] + adamw_elems / group for k in range(group)]
    held = dense_elems / tp + expert_elems_here + adamw_elems / tp  # what a rank holds (BF16 params)
    replicated_state = MUON_STATE_BYTES * (dense_elems / tp + expert_elems_here) + ADAMW_STATE_BYTES * adamw_elems / tp
    gather = 2.0 * (dense_elems / tp + adamw_elems / tp) * (dp - 1) / dp \
        + 2.0 * expert_elems_here * (expert_dp - 1) / expert_dp
    exchange = 2 * 4.0 * dense_elems * (tp - 1) / tp / tp if tp > 1 else 0.0
    return {"model": model.name, "pp": pp, "dp": dp, "tp": tp, "ep": ep, "gpus": pp * dp * tp,
            "params_held_per_rank": held,
            "state_bytes_per_rank": max(state), "state_bytes_replicated": replicated_state,
            "state_bytes_per_held_param": max(state) / held, "replicated_bytes_per_held_param": replicated_state / held,
            "polar_flops_per_rank": max(flops), "polar_imbalance": imbalance(flops),
            "polar_imbalance_dense": imbalance(loads), "polar_imbalance_experts": imbalance(e_loads),
            "bytes_sent_gather": gather, "bytes_sent_exchange": exchange,
            # the owner's elementwise passes: its state read and written, its params read and written (BF16),
            # its grads read (FP32 main grads)
            "elementwise_bytes": max(state) * 2 + owned[busiest] * (2 * 2 + 4), "busiest_rank": busiest}


def predict(row: Dict, model: Model, device: str, polar_tflops: float, link_gbps: float, nvlink_gbps: float,
            mfu: float, overlap: bool) -> Dict:
    polar_s = row["polar_flops_per_rank"] / (polar_tflops * 1e12)
    elementwise_s = row["elementwise_bytes"] / (0.7 * HBM_TBPS[device] * 1e12)
    gather_s = row["bytes_sent_gather"] / (link_gbps * 1e9)
    exchange_s = row["bytes_sent_exchange"] / (nvlink_gbps * 1e9)  # TP ranks share a node
    exposed = polar_s + elementwise_s + exchange_s + (0 if overlap else gather_s)
    comm_s = gather_s + exchange_s
    train_s = 6 * model.active_params * model.tokens_per_step / (row["gpus"] * BF16_PEAK_TFLOPS * 1e12 * mfu)
    return {"device": device, "polar_s": polar_s, "elementwise_s": elementwise_s, "comm_s": comm_s,
            "optimizer_s": exposed, "train_step_s": train_s, "fraction": exposed / train_s}


LAYOUTS = {
    "Llama-3 8B": [(1, 8, 1, 1), (1, 64, 1, 1), (1, 128, 8, 1), (1, 1024, 1, 1)],
    "Llama-3 70B": [(1, 64, 8, 1), (4, 32, 8, 1), (1, 128, 8, 1), (4, 256, 8, 1)],
    "Kimi-K2-like MoE (1.0T)": [(4, 64, 1, 64), (16, 64, 1, 64), (4, 256, 1, 64), (8, 128, 8, 64)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scale_plan.json"))
    parser.add_argument("--polar-tflops", type=float, default=400.0)
    parser.add_argument("--link-gbps", type=float, default=40.0)
    parser.add_argument("--nvlink-gbps", type=float, default=450.0)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--no-overlap", action="store_true")
    args = parser.parse_args()
    models = [llama3("Llama-3 8B", 4096, 32, 1024, 14336, 128256, 16e6),
              llama3("Llama-3 70B", 8192, 80, 1024, 28672, 128256, 16e6), kimi_k2_like()]
    rows = []
    print(f"{'model':26} {'PPxDPxTP EP':>16} {'state B/param':>14} {'(replicated)':>12} {'PE imbal':>8} "
          f"{'GB sent':>8} {'H100 opt ms':>11} {'H200 opt ms':>11} {'train s':>8} {'H100 %':>7} {'H200 %':>7}")
    for model in models:
        for pp, dp, tp, ep in LAYOUTS[model.name]:
            row = plan(model, pp, dp, tp, ep)
            row["predicted"] = [predict(row, model, dev, args.polar_tflops, args.link_gbps, args.nvlink_gbps,
                                        args.mfu, not args.no_overlap) for dev in ("H100", "H200")]
            rows.append(row)
            h100, h200 = row["predicted"]
            print(f"{model.name:26} {f'{pp}x{dp}x{tp} {ep}':>16} {row['state_bytes_per_held_param']:14.3f} "
                  f"{row['replicated_bytes_per_held_param']:12.2f} {row['polar_imbalance']:8.3f} "
                  f"{(row['bytes_sent_gather'] + row['bytes_sent_exchange']) / 1e9:8.2f} "
                  f"{h100['optimizer_s'] * 1e3:11.1f} {h200['optimizer_s'] * 1e3:11.1f} {h100['train_step_s']:8.2f} "
                  f"{100 * h100['fraction']:7.2f} {100 * h200['fraction']:7.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"assumptions": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
