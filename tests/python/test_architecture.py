"""The package's module structure: one job per module, no module but
__init__ imports optimizer.py, no import cycles, no reaching into another
object's private members, and type aliases that name the C++ table's modes."""

import ast
import pathlib
import typing

import muon_ext
from muon_ext import _types, schema

PACKAGE = pathlib.Path(muon_ext.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def _tree(module: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{module}.py").read_text(), filename=f"{module}.py")


def _imports(module: str) -> set:
    """The muon_ext modules `module` imports (at any level, TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("muon_ext"):
                continue
            base = (node.module or "").removeprefix("muon_ext").lstrip(".")
            if base:
                found.add(base.split(".")[0])
            else:  # `from . import x, y`
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "muon_ext" and len(parts) > 1:
                    found.add(parts[1])
    return found & set(MODULES)


def test_the_modules_are_the_planned_ones():
    for module in ("_types", "_shapes", "schema", "grouping", "state", "buckets", "amp", "checkpoint", "optimizer",
                   "offload", "ops", "reference"):
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


def test_no_private_members_of_other_objects_are_used():
    """`x._name` only on self (and modules' own private helpers by bare name):
    modules talk through each other's public interface."""
    allowed_owners = {"self", "cls", "torch", "muon_ext"}  # torch._C etc. are torch's business
    offenders = []
    for module in MODULES:
        for node in ast.walk(_tree(module)):
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
            offenders.append(f"{module}.py:{node.lineno}: .{node.attr}")
    assert offenders == []


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
