"""muon_ext: a fast, memory-lean Muon + AdamW optimizer for PyTorch (CPU and CUDA).

Public API: `MuonAdamW` (with `OffloadConfig`) and `param_groups`, `muon_ext.ops` (the kernels),
`muon_ext.quantized` (FP8 copies and their param writer) and `muon_ext.reference` (the plain
PyTorch math they are tested against).
"""

import torch

try:
    from ._build_info import TORCH_VERSION as _BUILT_TORCH_VERSION
except ImportError as exc:  # pragma: no cover - only in a source tree that was never built
    raise ImportError(
        "muon_ext is not built: install it with `pip install .` (see README.md)"
    ) from exc

if str(torch.__version__) != _BUILT_TORCH_VERSION:
    raise ImportError(
        f"muon_ext was built against torch {_BUILT_TORCH_VERSION}, but torch {torch.__version__} "
        "is installed. Reinstall muon_ext against this torch "
        "(`pip install --no-build-isolation --force-reinstall .`) or install the torch it was built for."
    )

from . import _C  # noqa: E402  (after the version check: a mismatched _C may not even load)
from . import ops, reference  # noqa: E402
from . import quantized  # noqa: E402
from .grouping import param_groups  # noqa: E402
from .offload import OffloadConfig  # noqa: E402
from .optimizer import MuonAdamW  # noqa: E402

__version__ = "0.1.0"
with_cuda = bool(_C.with_cuda)

__all__ = ["MuonAdamW", "OffloadConfig", "param_groups", "ops", "quantized", "reference", "with_cuda", "__version__"]
