"""Build script for muon_ext.

CPU kernels are always built; CUDA kernels are built when torch has CUDA and
nvcc is found (CUDA_HOME, default /usr/local/cuda), unless MUON_EXT_FORCE_CPU=1.
The CPU AdamW kernel is compiled once per instruction set (DEFAULT, AVX2,
AVX512 on x86-64) and picked at run time, as PyTorch does for its own kernels.
The C++ standard, the flags every C++ file gets and the per-ISA table are read
from csrc/build_flags.json, which CMakeLists.txt (the C++ tests) reads too.
"""

import json
import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"

# Shared with CMakeLists.txt; its _comment says what each entry means.
BUILD_FLAGS = json.loads((CSRC / "build_flags.json").read_text())
CXX_STD = f"-std=c++{BUILD_FLAGS['cxx_standard']}"



def _torch_parallel_backend_is_openmp() -> bool:
    """torch's own build setting (ATen/Config.h), not a guess from the platform."""
    config = Path(torch.__file__).resolve().parent / "include" / "ATen" / "Config.h"
    return "#define AT_PARALLEL_OPENMP 1" in config.read_text()


# at::parallel_for is inlined into our code: it runs threads only where it is
# compiled with the OpenMP flags torch was built with (build_flags.json).
OPENMP = BUILD_FLAGS["openmp"] if _torch_parallel_backend_is_openmp() and sys.platform != "darwin" else None
OPENMP_CXX_FLAGS = OPENMP["cxx_flags"] if OPENMP else []
OPENMP_LINK_FLAGS = OPENMP["link_flags"] if OPENMP else []

CXX_FLAGS = ["-O3", CXX_STD] + BUILD_FLAGS["cxx_flags"] + OPENMP_CXX_FLAGS
# --fmad=false keeps the GPU element math bit-identical to the CPU's.
NVCC_FLAGS = ["-O3", CXX_STD, "--fmad=false", "--expt-relaxed-constexpr"]

# Per-ISA builds of the vectorized CPU kernels.
ISA_KERNEL_SOURCES = BUILD_FLAGS["isa_kernel_sources"]


def _want_cuda() -> bool:
    if os.environ.get("MUON_EXT_FORCE_CPU", "0") == "1":
        return False
    if torch.version.cuda is None:
        return False
    nvcc = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
    return nvcc.exists()


def _isa_variants():
    """(name, compiler flags) of each instruction set built on this machine, DEFAULT first."""
    machine = platform.machine().lower()
    return [
        (v["name"], v["flags"])
        for v in BUILD_FLAGS["isa_variants"]
        if not v["machines"] or machine in (m.lower() for m in v["machines"])
    ]


def _nvidia_include_dirs():
    """cuBLAS and friends ship their headers in the `nvidia` wheels, not in CUDA_HOME."""
    dirs = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cublas/include", "nvidia/cuda_runtime/include"):
            candidate = Path(entry) / sub
            if candidate.is_dir() and str(candidate) not in dirs:
                dirs.append(str(candidate))
    return dirs


def _abi_flag():
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension plus one object file per (ISA kernel, instruction set)."""

    def build_extensions(self):
        for ext in self.extensions:
            ext.extra_objects = list(ext.extra_objects or []) + self._compile_isa_kernels(ext)
        super().build_extensions()

    def _compile_isa_kernels(self, ext):
        """Every (instruction set, source) pair compiled in parallel, MAX_JOBS at
        a time as torch's ninja build does (polar_small_kernel.cpp alone takes
        tens of seconds per instruction set: one after another they were a large
        part of a GPU machine's build)."""

        def compile_one(isa, isa_flags, source):
            return self.compiler.compile(
                [source],
                output_dir=os.path.join(self.build_temp, f"isa_{isa.lower()}"),
                macros=[("CPU_CAPABILITY", isa), (f"CPU_CAPABILITY_{isa}", None)],
                include_dirs=ext.include_dirs,
                extra_postargs=CXX_FLAGS + ["-fPIC", _abi_flag()] + isa_flags,
            )

        jobs = [(isa, flags, source) for isa, flags in _isa_variants() for source in ISA_KERNEL_SOURCES]
        workers = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
            # Threads suffice: each job waits on a compiler process. map keeps the link order.
            return [obj for objects in pool.map(lambda job: compile_one(*job), jobs) for obj in objects]


def _write_build_info(with_cuda: bool):
    info = ROOT / "muon_ext" / "_build_info.py"
    info.write_text(
        '"""Written by setup.py: what this build of muon_ext was compiled against."""\n'
        f"TORCH_VERSION = {str(torch.__version__)!r}\n"
        f"WITH_CUDA = {with_cuda!r}\n"
        f"CUDA_ARCH_LIST = {os.environ.get('TORCH_CUDA_ARCH_LIST', '') if with_cuda else ''!r}\n"
        f"CPU_ISA_VARIANTS = {tuple(isa for isa, _ in _isa_variants())!r}\n"
        f"OPENMP = {OPENMP is not None!r}\n"
    )


def _extension():
    with_cuda = _want_cuda()
    if with_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to query: build for Ampere and Hopper.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    _write_build_info(with_cuda)

    macros = [f"-DMUON_EXT_HAVE_{isa}" for isa, _ in _isa_variants() if isa != "DEFAULT"]
    sources = ["csrc/bindings.cpp", "csrc/ops.cpp", "csrc/checks.cpp", "csrc/step_checks.cpp", "csrc/cpu/adamw_cpu.cpp", "csrc/cpu/muon_cpu.cpp", "csrc/cpu/bf16_tile_gemm.cpp",
               "csrc/cpu/polar_small.cpp", "csrc/cpu/scratch_pool.cpp",
               "csrc/cpu/remainder_cpu.cpp", "csrc/cpu/parallel_probe.cpp", "csrc/quantize_ops.cpp",
               "csrc/cpu/quantize_cpu.cpp", "csrc/sharded_polar_ops.cpp"]
    include_dirs = [str(CSRC)]
    cxx_flags = CXX_FLAGS + macros
    if with_cuda:
        sources += ["csrc/cuda/adamw_cuda.cu", "csrc/cuda/muon_cuda.cu", "csrc/cuda/polar_express_cuda.cu",
                    "csrc/cuda/remainder_cuda.cu", "csrc/cuda/quantize_cuda.cu"]
        include_dirs += _nvidia_include_dirs()
        cxx_flags = cxx_flags + ["-DMUON_EXT_WITH_CUDA"]
        return cpp_extension.CUDAExtension(
            "muon_ext._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags, "nvcc": NVCC_FLAGS + ["-DMUON_EXT_WITH_CUDA"]},
            extra_link_args=OPENMP_LINK_FLAGS,
        )
    return cpp_extension.CppExtension(
        "muon_ext._C", sources, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags},
        extra_link_args=OPENMP_LINK_FLAGS,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension},
    # The wheel runs only with the torch it was compiled against.
    install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
)
