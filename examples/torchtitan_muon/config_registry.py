"""A torchtitan recipe: llama3 with MuonAdamW selected from the config.

On GPUs, from a torchtitan checkout (its tests/assets hold the debug tokenizer and data):

    PYTHONPATH=/path/to/muon_ext/examples torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module torchtitan_muon --config llama3_debugmodel_muon --parallelism.tensor_parallel_degree 2

The qwen3 MoE debug model (routed experts on Muon, each expert its own matrix) under EP 2 x FSDP 2:

    PYTHONPATH=/path/to/muon_ext/examples torchrun --nproc_per_node 4 -m torchtitan.train \\
        --module torchtitan_muon --config qwen3_moe_debug_muon --parallelism.expert_parallel_degree 2

On a CPU-only machine: python examples/train_titan.py (applies the CPU patches torchtitan 0.3.0 needs;
--model qwen3_moe for the MoE model).
"""

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

from muon_ext.torchtitan import muon_adamw


def llama3_debugmodel_muon():
    """torchtitan's llama3 debug model; hidden matrices on Muon, embeddings, output and norms on AdamW, both at the
    recipe's AdamW lr (8e-4) and weight decay (docs/guide.md, "One learning rate")."""
    config = llama3_debugmodel()
    config.optimizer = muon_adamw(lr=8e-4)
    return config


def llama3_8b_muon():
    config = llama3_8b()
    config.optimizer = muon_adamw(lr=3e-4, optimizer_options={"master_weights": "auto"})  # llama3_8b's AdamW lr
    return config


def qwen3_moe_debug_muon():
    """torchtitan's qwen3 MoE debug recipe; attention, shared and routed experts on Muon (lr 0.02; each routed
    expert of a [E, out, in] stack its own matrix), embeddings, output, norms and the router on AdamW (3e-4, the
    recipe's lr). torchtitan's load-balancing expert bias keeps working (its optimizer step pre-hook)."""
    config = qwen3_moe_debug()
    config.optimizer = muon_adamw(lr=0.02, adamw_lr=3e-4)
    return config
