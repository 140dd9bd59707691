"""muon_ext.param_groups: which params go to Muon and which to AdamW."""

import torch
import torch.nn.functional as F

import muon_ext


class _Block(torch.nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.fc = torch.nn.Linear(d, hidden)
        self.proj = torch.nn.Linear(hidden, d)


class _GPT(torch.nn.Module):
    """Token and position embeddings, blocks, and a head that is either an
    untied nn.Linear named `head_name` or the token embedding (tied)."""

    def __init__(self, vocab=64, positions=32, d=16, hidden=32, layers=2, head_name=None):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(positions, d)
        self.blocks = torch.nn.ModuleList(_Block(d, hidden) for _ in range(layers))
        if head_name is not None:
            self.add_module(head_name, torch.nn.Linear(d, vocab, bias=False))
        self.head_name = head_name

    def forward(self, idx):
        x = self.wte(idx)
        head = self.wte.weight if self.head_name is None else getattr(self, self.head_name).weight
        return F.linear(x, head)


def _split(model, **kwargs):
    groups = muon_ext.param_groups(model, **kwargs)
    by_kind = {g["kind"]: set(g["param_names"]) for g in groups}
    return by_kind.get("muon", set()), by_kind.get("adamw", set())


def test_hidden_matrices_to_muon_embeddings_head_norms_biases_to_adamw():
    muon, adamw = _split(_GPT(head_name="out"))  # a head name no pattern knows: found as the last Linear
    hidden = {f"blocks.{i}.{n}.weight" for i in range(2) for n in ("qkv", "fc", "proj")}
    assert muon == hidden
    assert {"wte.weight", "wpe.weight", "out.weight", "blocks.0.ln.weight", "blocks.1.qkv.bias"} <= adamw
    assert muon.isdisjoint(adamw)


def test_a_hidden_layer_as_wide_as_an_embedding_stays_on_muon():
    """Tied head, MLP width equal to the position embedding's size: no Linear is
    the head, so every block's fc stays on Muon."""
    muon, adamw = _split(_GPT(vocab=64, positions=32, hidden=32, head_name=None))
    assert {"blocks.0.fc.weight", "blocks.1.fc.weight"} <= muon
    assert "wte.weight" in adamw


def test_heads_by_name_and_patterns():
    muon, adamw = _split(_GPT(head_name="lm_head"))
    assert "lm_head.weight" in adamw
    muon, adamw = _split(_GPT(head_name="out"), adamw_patterns=[r"qkv"], muon_patterns=[r"^wpe\."])
    assert "blocks.0.qkv.weight" in adamw and "wpe.weight" in muon


def test_frozen_and_shared_params():
    model = _GPT(head_name="out")
    model.blocks[0].fc.weight.requires_grad_(False)
    model.blocks[1].proj.weight = model.blocks[0].proj.weight  # shared: listed once
    groups = muon_ext.param_groups(model)
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed})
    assert all(p is not model.blocks[0].fc.weight for p in listed)


def test_conv_weights_go_to_muon_flattened():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    groups = muon_ext.param_groups(model)
    muon = next(g for g in groups if g["kind"] == "muon")
    assert muon["param_names"] == ["0.weight", "2.weight"] and muon["matrix_view"] == "flatten"
    muon_ext.MuonAdamW(groups)  # accepted as they are


def test_group_settings():
    groups = muon_ext.param_groups(_GPT(head_name="out"), lr=0.03, adamw_lr=1e-3, weight_decay=0.2,
                                   adamw_weight_decay=0.01, momentum=0.9, beta2=None)
    muon, adamw = groups
    assert (muon["kind"], muon["lr"], muon["weight_decay"], muon["matrix_view"]) == ("muon", 0.03, 0.2, "flatten")
    assert muon["momentum"] == 0.9 and muon["beta2"] is None
    assert (adamw["kind"], adamw["lr"], adamw["weight_decay"]) == ("adamw", 1e-3, 0.01)
    assert len(muon["params"]) == len(muon["param_names"]) and len(adamw["params"]) == len(adamw["param_names"])


def test_one_learning_rate_by_default():
    """docs/guide.md, "One learning rate": without two lrs, one lr serves both
    kinds and the Muon group scales its updates to AdamW's update RMS."""
    model = _GPT(head_name="out")
    for kwargs, one in (({}, muon_ext.grouping.DEFAULT_LR), ({"lr": 2e-3}, 2e-3), ({"adamw_lr": 1e-3}, 1e-3)):
        muon, adamw = muon_ext.param_groups(model, **kwargs)
        assert (muon["lr"], adamw["lr"], muon["lr_scale"]) == (one, one, "match_rms_adamw"), kwargs
        assert (muon["weight_decay"], adamw["weight_decay"]) == (0.1, 0.0)
    muon, _ = muon_ext.param_groups(model, lr=2e-3, lr_scale="none")  # an explicit lr_scale wins
    assert muon["lr_scale"] == "none"


def test_two_learning_rates_keep_the_previous_groups():
    """Both lrs given: the groups of before the one-lr default (no lr_scale key:
    MuonAdamW's default "original"), unless lr_scale is given."""
    model = _GPT(head_name="out")
    muon, adamw = muon_ext.param_groups(model, lr=0.02, adamw_lr=3e-4)
    assert (muon["lr"], adamw["lr"]) == (0.02, 3e-4) and "lr_scale" not in muon
    assert muon_ext.MuonAdamW([muon, adamw]).param_groups[0]["lr_scale"] == "original"
    muon, _ = muon_ext.param_groups(model, lr=0.02, adamw_lr=3e-4, lr_scale="match_rms_adamw")
    assert muon["lr_scale"] == "match_rms_adamw"


def test_a_checkpoint_of_two_learning_rates_resumes_under_the_new_default():
    """A state dict saved with the two-lr groups loads into an optimizer built
    with the one-lr default: its saved lr and lr_scale replace the new ones, and
    the next step equals the one of the optimizer that saved it."""

    def build(seed, **kwargs):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16))
        return model, muon_ext.MuonAdamW(muon_ext.param_groups(model, **kwargs))

    def step(model, opt):
        opt.zero_grad()
        model(torch.arange(8).view(2, 4)).square().mean().backward()
        opt.step()

    old_model, old_opt = build(0, lr=0.02, adamw_lr=3e-4)
    step(old_model, old_opt)
    saved_model, saved_opt = old_model.state_dict(), old_opt.state_dict()
    new_model, new_opt = build(1)
    new_model.load_state_dict(saved_model)
    new_opt.load_state_dict(saved_opt)
    muon = new_opt.param_groups[0]
    assert muon["param_names"] == ["1.weight", "3.weight"]
    assert (muon["lr"], muon["lr_scale"], new_opt.param_groups[1]["lr"]) == (0.02, "original", 3e-4)
    step(old_model, old_opt)
    step(new_model, new_opt)
    for (name, p), q in zip(old_model.named_parameters(), new_model.parameters()):
        assert torch.equal(p, q), name
