"""The build contract: tlt_core._C never links libtorch, and a CPU-only build (TLT_CUDA=off)
imports and works with no CUDA library in sight."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tlt_core
from tlt_core import _C


def test_extension_does_not_link_torch():
    if not shutil.which("ldd"):
        pytest.skip("ldd not available")
    linked = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True).stdout
    assert "libtorch" not in linked and "libc10" not in linked, linked


def test_cpu_only_build_imports_and_runs(tmp_path):
    """.ci/run builds build/cpu-only with TLT_CUDA=off and points us at it."""
    module_dir = os.environ.get("TLT_CPU_ONLY_MODULE_DIR")
    if not module_dir:
        pytest.skip("set TLT_CPU_ONLY_MODULE_DIR to a TLT_CUDA=off build (done by .ci/run)")
    package = tmp_path / "tlt_core"
    shutil.copytree(Path(tlt_core.__file__).parent, package,
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    (built,) = Path(module_dir).glob("_C*.so")
    shutil.copy(built, package / built.name)
    script = (
        "import torch, tlt_core.ops as ops\n"
        "assert not ops.built_with_cuda\n"
        "out = ops.verify_tree_greedy(torch.zeros(1, 2, 5), torch.tensor([[0, 0]]), torch.tensor([[-1, 0]]))\n"
        "assert out.num_accepted.tolist() == [1], out\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if "CUDA" not in k}
    env.update(PYTHONPATH=str(tmp_path), LD_LIBRARY_PATH="")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
