"""The installed build: CUDA kernels present where they can be built, torch pin."""

import os
import shutil
from pathlib import Path

import torch

import muon_ext
from support.helpers import run_python
from muon_ext import _build_info


def _cuda_toolchain_present() -> bool:
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return torch.version.cuda is not None and (nvcc.exists() or shutil.which("nvcc") is not None)


def test_cuda_kernels_built_whenever_a_cuda_toolchain_exists():
    # CI has nvcc and a CUDA torch but no GPU: this proves the CUDA sources compiled.
    if os.environ.get("MUON_EXT_FORCE_CPU") == "1" or not _cuda_toolchain_present():
        assert muon_ext.with_cuda == _build_info.WITH_CUDA
        return
    assert muon_ext.with_cuda, "a CUDA toolchain is present but muon_ext was built without CUDA kernels"


def test_built_against_the_running_torch():
    assert _build_info.TORCH_VERSION == str(torch.__version__)


def test_import_refuses_a_different_torch():
    code = "import torch; torch.__version__ = '0.0.1'; import muon_ext"
    result = run_python(code)
    assert result.returncode != 0
    assert "muon_ext was built against torch" in result.stderr
    assert "0.0.1" in result.stderr


def test_import_needs_no_gpu():
    # A CUDA-enabled build must import (and run CPU kernels) where no GPU is visible.
    code = ("import torch, muon_ext; from muon_ext import ops; p = torch.zeros(3); "
            "ops.adamw_step([p], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(())], lr=0.1); "
            "print(p.tolist())")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = run_python(code, env=env)
    assert result.returncode == 0, result.stderr
    assert [round(x, 6) for x in eval(result.stdout)] == [-0.1, -0.1, -0.1]


def test_every_subpackage_is_installed():
    # pyproject.toml lists the packages a wheel holds: a subpackage missing there imports from a source tree only.
    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(root).parts) for init in (root / "muon_ext").rglob("__init__.py")}
    assert found == listed
