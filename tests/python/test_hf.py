"""muon_ext.hf against the real transformers Trainer (CPU, a tiny
LlamaForCausalLM built from a config: no download): the groups, training
with MuonTrainer, the factory form and a ready optimizer, and a checkpoint
resumed to the very params of a run that never stopped."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install '.[hf]'")
pytest.importorskip("accelerate", reason="Trainer needs accelerate: pip install '.[hf]'")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

from muon_ext import MuonAdamW  # noqa: E402
from muon_ext.hf import MuonAdamWFactory, MuonTrainer, create_optimizer, param_groups  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from train_hf import SEQ, VOCAB, Tokens  # noqa: E402  (the example's data: learnable sequences)

STEPS = 20


def tiny_llama(tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config)


def _args(out, **kw):
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, learning_rate=3e-3,
                weight_decay=0.0, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, save_strategy="steps",
                save_steps=10, report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
                disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _muon_adamw(trainer):
    """The trainer's optimizer under accelerate's AcceleratedOptimizer wrapper."""
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, MuonAdamW), type(opt)
    return opt


def _losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_param_groups_for_a_llama():
    """Hidden matrices to Muon; embeddings, lm_head (once where tied), norms to
    AdamW with TrainingArguments' betas and eps; MoE routers to AdamW."""
    for tie in (True, False):
        model = tiny_llama(tie)
        groups = param_groups(model, adamw_betas=(0.8, 0.9), adamw_eps=1e-6)
        muon, adamw = groups
        assert muon["kind"] == "muon" and adamw["kind"] == "adamw"
        assert all(n.endswith("proj.weight") for n in muon["param_names"]) and len(muon["params"]) == 14
        want = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tie else set())
        assert want <= set(adamw["param_names"])
        assert adamw["betas"] == (0.8, 0.9) and adamw["eps"] == 1e-6
        every = [id(p) for g in groups for p in g["params"]]
        assert len(every) == len(set(every)) == len({id(p) for p in model.parameters()})

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block_sparse_moe = torch.nn.Module()
            self.block_sparse_moe.gate = torch.nn.Linear(8, 4, bias=False)
            self.w1 = torch.nn.Linear(8, 8, bias=False)

    moe = param_groups(Moe())
    assert moe[0]["param_names"] == ["w1.weight"] and moe[1]["param_names"] == ["block_sparse_moe.gate.weight"]


def test_one_learning_rate_from_training_arguments(tmp_path):
    """docs/guide.md, "One learning rate": without `lr`, TrainingArguments'
    learning_rate and weight_decay serve both kinds, Muon scaled to AdamW's
    update RMS; with `lr`, Muon keeps its own (the two-lr form)."""
    args = _args(tmp_path, weight_decay=0.05)
    muon, adamw = create_optimizer(tiny_llama(tie=False), args).param_groups
    assert (muon["lr"], muon["weight_decay"], muon["lr_scale"]) == (3e-3, 0.05, "match_rms_adamw")
    assert (adamw["lr"], adamw["weight_decay"]) == (3e-3, 0.05)
    muon, adamw = create_optimizer(tiny_llama(tie=False), args, lr=0.02).param_groups
    assert (muon["lr"], muon["weight_decay"], muon["lr_scale"], adamw["lr"]) == (0.02, 0.1, "original", 3e-3)
    muon, adamw = MuonAdamWFactory()(tiny_llama(tie=False), lr=1e-3).param_groups  # one lr, no TrainingArguments
    assert (muon["lr"], muon["lr_scale"], adamw["lr"]) == (1e-3, "match_rms_adamw", 1e-3)


def test_trainer_trains_and_resumes_exactly(tmp_path):
    """MuonTrainer: 20 steps, the loss falls; a run resumed from its step-10
    checkpoint (model, MuonAdamW state, scheduler, RNG, data position) ends on
    the very params and optimizer state of the run that never stopped. The
    AdamW group takes TrainingArguments' learning rate."""
    model = tiny_llama(tie=True)
    trainer = MuonTrainer(model=model, args=_args(tmp_path / "a"), train_dataset=Tokens(),
                          muon_options={"lr": 0.02})
    trainer.train()
    opt = _muon_adamw(trainer)
    assert opt.param_groups[1]["kind"] == "adamw" and opt.param_groups[1]["initial_lr"] == 3e-3
    losses = _losses(trainer)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses

    resumed_model = tiny_llama(tie=True, seed=1)  # other values: the checkpoint must replace them
    resumed = MuonTrainer(model=resumed_model, args=_args(tmp_path / "b"), train_dataset=Tokens(),
                          muon_options={"lr": 0.02})
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-10"))
    for (name, p), (_, q) in zip(model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(p, q), name
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, _muon_adamw(resumed).state[q][key]), key
    assert _losses(resumed) == losses  # the first 10 from the checkpoint's log history, the last 10 recomputed


def test_factory_and_ready_optimizer_forms(tmp_path):
    """optimizer_cls_and_kwargs=(MuonAdamWFactory, kwargs) and
    optimizers=(create_optimizer(model, args), None) train like MuonTrainer."""
    args = _args(tmp_path / "c", max_steps=4, save_strategy="no")
    finals = []
    for build in ("trainer", "factory", "ready"):
        model = tiny_llama(tie=False)
        if build == "trainer":
            trainer = MuonTrainer(model=model, args=args, train_dataset=Tokens(), muon_options={"lr": 0.02})
        elif build == "factory":
            kwargs = {"lr": 0.02, "adamw_lr": args.learning_rate, "adamw_weight_decay": args.weight_decay,
                      "adamw_betas": (args.adam_beta1, args.adam_beta2), "adamw_eps": args.adam_epsilon}
            trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                           optimizer_cls_and_kwargs=(MuonAdamWFactory, kwargs))
        else:
            trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                           optimizers=(create_optimizer(model, args, lr=0.02), None))
        trainer.train()
        _muon_adamw(trainer)
        finals.append([p.detach().clone() for p in model.parameters()])
    for other in finals[1:]:
        assert all(torch.equal(a, b) for a, b in zip(finals[0], other))


def test_example_compares_both_optimizers(tmp_path):
    """examples/train_hf.py --compare, a few steps of a tiny model: both runs recorded, both held-out losses,
    the plot written."""
    import train_hf

    runs, held_out = train_hf.main(["--compare", "--steps", "3", "--hidden", "16", "--batch", "4",
                                    "--plot", str(tmp_path / "loss.png")])
    assert set(runs) == set(held_out) == {"MuonAdamW", "Trainer AdamW"}
    for records in runs.values():
        assert [r["step"] for r in records] == [1, 2, 3] and all(r["seconds"] > 0 for r in records)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loss.png").stat().st_size > 1000
