"""GPU tests are marked `gpu` and skipped cleanly where no CUDA device (or no CUDA build of the
kernels) is available, so the suite runs unchanged on a CPU-only machine."""

import pytest
import torch


def cuda_ready() -> tuple[bool, str]:
    import tlt_core.ops as ops

    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if not ops.built_with_cuda:
        return False, "tlt_core was built without CUDA kernels"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ready, why = cuda_ready()
    if ready:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def target():
    """The tiny sharp target of tests/speculative_fixtures.py (a module may define its own)."""
    from tests.speculative_fixtures import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    """A drafter briefly trained on `target`'s greedy continuations."""
    from tests.speculative_fixtures import train_drafter

    return train_drafter(target)
