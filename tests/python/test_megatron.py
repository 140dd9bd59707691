"""MuonAdamW as Megatron-Core's Muon (muon_ext.megatron), against the real
megatron-core on the CPU: one spawned 2-process gloo job running the cases of
megatron_cases.py (TP=1 and TP=2 in the same world), and one 4-process job
for expert params (megatron_expert_cases.py), under a collective timeout and a
join deadline."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed: pip install '.[megatron]'")


def test_megatron_tp1_tp2_training_norms_scheduler_fp16_and_resume(tmp_path):
    from support import megatron_cases as cases
    from support.dist_helpers import spawn

    spawn(tmp_path, 2, cases.run_all, [
        (cases.dist_checkpoint_across_tp, (str(tmp_path / "ckpt"),)),
        (cases.normuon_tp_modes_split_qkv_and_resume, (str(tmp_path / "ckpt"),)),
        (cases.qk_clip_matches_megatron_math_at_tp2, ()),
        (cases.qk_clip_scales_local_rows_without_tp_collectives, ()),
        (cases.qk_clip_leaves_groups_at_or_below_the_threshold, ()),
        (cases.tp_modes_against_replayed_tp1, ()),
        (cases.qkv_split_against_hand_split_and_tp1, ()),
        (cases.blockwise_tp2_trains_like_tp1, ()),
        (cases.grad_norm_and_adamw_match_megatron_adam, ()),
        (cases.scheduler_drives_lr_and_decay, ()),
        (cases.fp16_skips_an_overflowing_step, ()),
        (cases.state_dict_resume_is_exact, ()),
        (cases.layer_wise_owns_a_share_and_matches_replicated, ()),
    ], timeout_s=600)


def test_megatron_expert_params_use_the_expert_tp_group(tmp_path):
    """A real MoE GPT (synthetic grads) on 4 gloo processes, at dense TP=1 / expert TP=2 / EP=2 and dense
    TP=2 / expert TP=1 / EP=2: every tp_mode against a plain MuonAdamW on the whole matrices, the grad norm
    and zero count against Megatron's ChainedOptimizer, fp16 skipping a step on every rank for an inf in one
    rank's expert grad, and a dist_checkpointing resume from the first layout to the
    second (support/megatron_expert_cases.py)."""
    from support import megatron_cases
    from support import megatron_expert_cases as cases
    from support.dist_helpers import spawn

    spawn(tmp_path, 4, cases.run_all, [
        (cases.experts_use_the_expert_tp_group, ()),
        (cases.fp16_inf_in_one_expert_skips_every_rank, ()),
        (cases.expert_checkpoint_across_layouts, (str(tmp_path / "ckpt"),)),
        (megatron_cases.layer_wise_owns_a_share_and_matches_replicated, ()),  # TP=2 blockwise x DP=2
    ], timeout_s=600)


@pytest.mark.parametrize("field, value, match", [
    ("use_distributed_optimizer", True, "use_distributed_optimizer"),
    ("muon_tp_mode", "sharded", "muon_tp_mode"),
    ("muon_scale_mode", "rms", "muon_scale_mode"),
    ("muon_fp32_matmul_prec", "low", "muon_fp32_matmul_prec"),
    ("muon_num_ns_steps", 0, "muon_num_ns_steps"),
    ("muon_extra_scale_factor", 0.0, "muon_extra_scale_factor"),
])
def test_unsupported_configs_are_refused_before_anything_is_built(field, value, match):
    from megatron.core.optimizer import OptimizerConfig

    from muon_ext.megatron import get_megatron_muon_optimizer

    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        get_megatron_muon_optimizer(config, [])  # no model, no process group: refused first


def test_match_rms_adamw_fields_scale_muon_updates_to_adamw_rms():
    """muon_ext.megatron.MATCH_RMS_ADAMW (docs/megatron.md, "One learning rate"): Megatron's
    spectral scale times 0.2, the factor of MuonAdamW's lr_scale="match_rms_adamw"."""
    from megatron.core.optimizer import OptimizerConfig

    from muon_ext.megatron import MATCH_RMS_ADAMW
    from muon_ext.megatron.config import check_config, muon_scale

    config = OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, **MATCH_RMS_ADAMW)
    check_config(config)
    for rows, cols in ((64, 64), (256, 64), (64, 192)):
        scale = muon_scale(rows, cols, config.muon_scale_mode, config.muon_extra_scale_factor)
        assert abs(scale - 0.2 * max(rows, cols) ** 0.5) < 1e-12
