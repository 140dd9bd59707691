"""Shared pytest configuration: GPU tests are skipped on machines without CUDA;
the `device` fixture ("cpu", and "cuda" marked gpu) for tests that run on
both; hypothesis profiles for the property tests (test_properties.py)."""

import os

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # only test_properties.py needs it; it fails at its own import
    settings = None

if settings is not None:
    # "ci" (default): a fixed set of examples (derandomize), so every CI run
    # tests the same cases and a failure reproduces; sized for a 2-core runner.
    # HYPOTHESIS_PROFILE=thorough: new random examples on every run, many more.
    # No example database: it would write .hypothesis/ into the working tree;
    # print_blob gives the @reproduce_failure line instead.
    _common = dict(deadline=None, database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", max_examples=25, derandomize=True, **_common)
    settings.register_profile("thorough", max_examples=500, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The device a test runs on: every test taking it runs on the CPU, and on CUDA where there is one."""
    return request.param


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
