"""The package's module structure, subpackages included: one job per module,
no module but __init__ imports optimizer.py, no import cycles, no reaching into
another object's private members, private torch members only in the one
compatibility module (_torch_compat.py), and type aliases that name the C++
table's modes."""

import ast
import pathlib
import typing

import pytest

import muon_ext
from muon_ext import _types, schema

PACKAGE = pathlib.Path(muon_ext.__file__).parent
# The one module that may use torch's private members (docs/design.md, "Module layout").
TORCH_COMPAT = "_torch_compat"


def _module_name(path: pathlib.Path) -> str:
    """A module's dotted name under muon_ext: "optimizer", "distributed.step";
    a subpackage's __init__ is the subpackage ("distributed"), the package's own is "__init__"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
MODULES = sorted(FILES)


def _tree(module: str) -> ast.Module:
    path = FILES[module]
    return ast.parse(path.read_text(), filename=str(path.relative_to(PACKAGE)))


def _package_of(module: str) -> str:
    """The package a module's relative imports start from ("" for muon_ext itself)."""
    if module == "__init__":
        return ""
    if FILES[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


def _imports(module: str) -> set:
    """The muon_ext modules `module` imports (at any level, TYPE_CHECKING blocks
    included), by dotted name; a name taken from a package's __init__ counts as
    importing that package ("__init__" for muon_ext's own)."""
    found = set()

    def add(dotted: str, names):
        # `from <dotted> import name`: the submodule `name` where there is one, else <dotted> itself.
        for name in names:
            candidate = f"{dotted}.{name}" if dotted else name
            found.add(candidate if candidate in FILES else (dotted or "__init__"))

    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("muon_ext"):
                    continue
                base = node.module.removeprefix("muon_ext").lstrip(".")
            else:
                base = _package_of(module)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                if node.module:
                    base = f"{base}.{node.module}" if base else node.module
            add(base, [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "muon_ext" and len(parts) > 1:
                    found.add(".".join(parts[1:]))
    return found & set(MODULES)


def test_the_walk_covers_the_subpackages():
    for module in ("distributed", "distributed.step", "distributed.placements", "distributed.tp_polar",
                   "megatron", "megatron.optimizer"):
        assert module in MODULES, module


def test_the_modules_are_the_planned_ones():
    for module in ("_types", "_shapes", "schema", "grouping", "state", "buckets", "amp", "checkpoint", "optimizer",
                   "offload", "ops", "reference", TORCH_COMPAT):
        assert module in MODULES, module


def test_only_init_imports_the_optimizer():
    importers = [m for m in MODULES if m != "__init__" and "optimizer" in _imports(m)]
    assert importers == [], f"{importers} import muon_ext.optimizer"
    assert "optimizer" not in _imports("checkpoint")


def test_no_import_cycles():
    graph = {m: _imports(m) - {"__init__"} for m in MODULES if m != "__init__"}

    def visit(module, path):
        assert module not in path, "import cycle: " + " -> ".join(path + [module])
        for dep in sorted(graph.get(module, ())):
            visit(dep, path + [module])

    for module in graph:
        visit(module, [])


def _torch_names(tree: ast.Module) -> set:
    """The names a module binds to torch or a torch submodule (`torch`, `dist` of `import torch.distributed as dist`)."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] == "torch")
    return names


def test_no_private_members_of_other_objects_are_used():
    """`x._name` only on self (and modules' own private helpers by bare name):
    modules talk through each other's public interface. torch's own (torch._C,
    dist._x, a DTensor placement's methods) are the next test's business: the
    compatibility module is where they are used."""
    offenders = []
    for module in MODULES:
        if module == TORCH_COMPAT:
            continue
        tree = _tree(module)
        allowed_owners = {"self", "cls", "muon_ext"} | _torch_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in allowed_owners:
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue  # a subclass extending its base's hook (muon_ext.torchtitan) talks to itself
            if isinstance(owner, ast.Attribute):  # e.g. torch._C._x: a chain rooted in an allowed name
                root = owner
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in allowed_owners:
                    continue
            offenders.append(f"{FILES[module].relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert offenders == []


def test_private_torch_members_only_in_the_compat_module():
    """`from torch.x._y import z`, `from torch.x import _z`, `import torch._y`
    and `torch._z` / `dist._z` appear only in _torch_compat.py."""
    offenders = []
    for module in MODULES:
        if module == TORCH_COMPAT:
            continue
        tree = _tree(module)
        torch_names = _torch_names(tree)
        where = FILES[module].relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
                private = [p for p in node.module.split(".") if p.startswith("_")]
                private += [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{where}:{node.lineno}: from {node.module} import {private}")
            elif isinstance(node, ast.Import):
                offenders += [f"{where}:{node.lineno}: import {alias.name}" for alias in node.names
                              if alias.name.split(".")[0] == "torch"
                              and any(p.startswith("_") for p in alias.name.split("."))]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in torch_names:
                    offenders.append(f"{where}:{node.lineno}: {root.id}...{node.attr}")
    assert offenders == []


def test_the_compat_module_documents_each_member():
    """Every private torch member it resolves is in its table, with why and the torch version checked, and
    exists in this torch; one that does not raises naming it."""
    from muon_ext import _torch_compat

    assert _torch_compat.PRIVATE_MEMBERS
    for entry in _torch_compat.PRIVATE_MEMBERS:
        path = f"{entry.owner}.{entry.member}".split(".")
        assert any(part.startswith("_") for part in path) and entry.why and entry.checked_with, entry
        _torch_compat._resolve(entry.owner, entry.member)
    with pytest.raises(RuntimeError, match=r"torch's private torch\._no_such_member.*checked against torch"):
        _torch_compat._resolve("torch", "_no_such_member")


def test_no_private_names_are_imported_from_sibling_modules():
    offenders = []
    for module in MODULES:
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
                offenders += [f"{module}.py: {alias.name} from .{node.module}" for alias in node.names
                              if alias.name.startswith("_")]
    assert offenders == []


def test_public_api_stays_small():
    assert sorted(muon_ext.__all__) == sorted(["MuonAdamW", "OffloadConfig", "param_groups", "ops", "quantized", "reference",
                                               "with_cuda", "__version__"])


def test_mode_aliases_name_the_cpp_table():
    """The Literal aliases of _types are type hints only; the accepted values
    come from the C++ table, and the two must agree."""
    aliases = {"master": _types.MasterMode, "lr_scale": _types.LrScale, "matrix_view": _types.MatrixView,
               "grad_attr": _types.GradAttr, "polar_dtype": _types.PolarDtype,
               "polar_method": _types.PolarMethod}
    assert set(schema.MODES) == set(aliases)
    for mode, alias in aliases.items():
        assert typing.get_args(alias) == schema.MODES[mode], mode
    assert set(typing.get_args(_types.Kind)) == set(schema.DEFAULTS)
    kinds = {kind for kind, _ in schema.RANGES}
    assert kinds == set(schema.DEFAULTS) | {"optimizer"}
