"""The installed build: CUDA kernels present where they can be built, torch pin."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
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


def test_gpu_check_probe_tells_a_statically_linked_libstdcxx_apart(tmp_path):
    """bench/gpu_check.sh's compiler probe (the first H200 run's crash: the
    image's g++ linked libstdc++ into _C.so): true for this host's g++, false
    for the same g++ forced to link libstdc++ statically; the script parses."""
    if shutil.which("g++") is None or shutil.which("ldd") is None or shutil.which("bash") is None:
        pytest.skip("needs g++, ldd and bash")
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    probe = re.search(r"^dynamic_libstdcxx\(\) \{.*?^\}\n", script.read_text(), re.S | re.M).group(0)
    static = tmp_path / "static-g++"
    static.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    static.chmod(0o755)
    out = subprocess.run(["bash", "-c", probe + f"""
dynamic_libstdcxx g++ {tmp_path}/a.so && echo host-dynamic
dynamic_libstdcxx {static} {tmp_path}/b.so || echo forced-static"""], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["host-dynamic", "forced-static"], out
