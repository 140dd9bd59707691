"""Adapters: installed distributions' entry points in the group
"muon_ext.adapters" are called with each new optimizer."""

import sys

import pytest
import torch

import muon_ext

ADAPTER_MODULE = '''
import torch
bound = []

def record(optimizer):
    bound.append(optimizer)

def register_writers(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.register_param_writer(p, lambda param, master, stream, found_inf: None)

def broken(optimizer):
    raise ValueError("adapter cannot bind")
'''


def _install(tmp_path, monkeypatch, module, entry_points):
    """A tiny distribution in `tmp_path` (a .dist-info with entry_points.txt), on sys.path."""
    (tmp_path / f"{module}.py").write_text(ADAPTER_MODULE)
    info = tmp_path / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {module}:{func}\n" for name, func in entry_points)
    (info / "entry_points.txt").write_text(f"[muon_ext.adapters]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)


def _groups():
    return [{"params": [torch.nn.Parameter(torch.randn(4, 4))], "kind": "muon"}]


def test_installed_adapters_bind_in_name_order(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "muon_ext_test_adapter_a", [("b_writers", "register_writers"),
                                                               ("a_record", "record")])
    assert [ep.name for ep in muon_ext.entry_points.installed()] == ["a_record", "b_writers"]
    opt = muon_ext.MuonAdamW(_groups())
    module = sys.modules["muon_ext_test_adapter_a"]
    assert module.bound == [opt]
    p = opt.param_groups[0]["params"][0]
    with pytest.raises(ValueError, match="already has a writer"):  # the adapter registered one
        opt.register_param_writer(p, lambda *a: None)
    skipped = muon_ext.MuonAdamW(_groups(), adapters=False)
    assert module.bound == [opt]
    skipped.register_param_writer(skipped.param_groups[0]["params"][0], lambda *a: None)


def test_failing_adapter_fails_construction_naming_it(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "muon_ext_test_adapter_b", [("bad_one", "broken")])
    with pytest.raises(RuntimeError, match=r"adapter 'bad_one' \(muon_ext_test_adapter_b:broken\).*cannot bind"):
        muon_ext.MuonAdamW(_groups())
    muon_ext.MuonAdamW(_groups(), adapters=False)
    with pytest.raises(TypeError, match="adapters must be True or False"):
        muon_ext.MuonAdamW(_groups(), adapters="no")


def test_missing_adapter_module_is_named(tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, "muon_ext_test_adapter_c", [("ghost", "no_such_function")])
    with pytest.raises(RuntimeError, match="adapter 'ghost'"):
        muon_ext.MuonAdamW(_groups())


def test_no_adapter_installed_binds_nothing():
    assert muon_ext.entry_points.installed() == []
    muon_ext.MuonAdamW(_groups())
