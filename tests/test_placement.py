"""Placement: `cpu_bf16_flag` reads the bf16 matrix units from /proc/cpuinfo (AMX first, nothing
on unreadable or flagless files); `resolve_placement` names the bad argument, follows the flag on
the CPU and LOCAL_RANK on CUDA; `peak_memory_bytes` counts bytes and `reset_peak_memory`
restarts it; `load_checkpoint` takes the same names as torch objects.

GPUs are simulated by monkeypatching torch.cuda's queries (only device objects are built), so
all but the `gpu` tests, which check the same on a real device, run on a CPU-only machine."""

import os
import subprocess
import sys

import pytest
import torch

import tlt_core.model.placement as placement
from tests.speculative_fixtures import tiny_target
from tlt_core.model.checkpoint import load_checkpoint, save_checkpoint
from tlt_core.model.placement import (Placement, cpu_bf16_flag, peak_memory_bytes,
                                      reset_peak_memory, resolve_placement)


def cpuinfo(tmp_path, *flag_lines: str) -> str:
    """A /proc/cpuinfo with one processor block per flags line, as Linux writes it."""
    blocks = [f"processor\t: {n}\nvendor_id\t: GenuineIntel\n{line}\n"
              for n, line in enumerate(flag_lines)]
    path = tmp_path / "cpuinfo"
    path.write_text("\n".join(blocks))
    return str(path)


def test_cpu_bf16_flag_prefers_amx_and_matches_whole_flags(tmp_path):
    both = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8"
    assert cpu_bf16_flag(cpuinfo(tmp_path, both, both)) == "amx_bf16"  # listed 2nd, still 1st
    assert cpu_bf16_flag(cpuinfo(tmp_path, "flags\t\t: avx2 avx512f avx512_bf16")) == \
        "avx512_bf16"
    # AMX without its bf16 unit, and AVX-512 without bf16: no native bf16 matmul
    assert cpu_bf16_flag(cpuinfo(tmp_path, "flags\t\t: avx512f amx_tile amx_int8")) is None
    # aarch64 names its features "Features": not flags this module knows
    assert cpu_bf16_flag(cpuinfo(tmp_path, "Features\t: fp asimd bf16 i8mm")) is None


def test_cpu_bf16_flag_reads_only_the_first_flags_line(tmp_path):
    # every processor block repeats the flags; the first block speaks for all
    path = cpuinfo(tmp_path, "flags\t\t: avx2", "flags\t\t: avx2 amx_bf16")
    assert cpu_bf16_flag(path) is None


def test_cpu_bf16_flag_is_none_when_unreadable(tmp_path):
    assert cpu_bf16_flag(tmp_path / "absent") is None
    assert cpu_bf16_flag(tmp_path) is None  # a directory: IsADirectoryError


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees a GPU with bf16 (tests flip is_bf16_supported); nothing runs on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


@pytest.mark.parametrize("device, dtype, names", [
    ("gpu", "auto", "device"), ("cuda:0", "auto", "device"), ("cpu", "fp16", "dtype"),
    ("cpu", "float64", "dtype"), ("cuda", "float32", "device: cuda")])
def test_errors_name_the_argument(no_cuda, device, dtype, names):
    with pytest.raises(ValueError, match=f"^{names}"):
        resolve_placement(device, dtype)


def test_requested_dtype_is_kept(no_cuda):
    chosen = resolve_placement("cpu", "bfloat16")
    assert chosen == Placement(torch.device("cpu"), torch.bfloat16, "as requested")
    assert chosen.describe() == "cpu, bfloat16 (as requested)"


@pytest.mark.parametrize("flag, dtype", [("amx_bf16", torch.bfloat16),
                                         ("avx512_bf16", torch.bfloat16), (None, torch.float32)])
def test_auto_dtype_on_the_cpu_follows_the_flag(no_cuda, monkeypatch, flag, dtype):
    monkeypatch.setattr(placement, "cpu_bf16_flag", lambda: flag)
    for device in ("auto", "cpu"):  # auto finds no GPU
        chosen = resolve_placement(device, "auto")
        assert (chosen.device, chosen.dtype) == (torch.device("cpu"), dtype)
        assert (flag or "no native bf16") in chosen.why
    assert resolve_placement("cpu", "float32").dtype == torch.float32  # a request beats auto


def unasked():
    raise AssertionError("cpu_bf16_flag was asked for a CUDA placement")


def test_cuda_takes_local_rank_and_bf16_when_supported(fake_gpu, monkeypatch):
    monkeypatch.setattr(placement, "cpu_bf16_flag", unasked)  # CUDA's dtype is not the CPU's
    assert resolve_placement("auto", "auto") == Placement(torch.device("cuda", 0), torch.bfloat16,
                                                          "auto: bf16 on CUDA")
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's rank on this node
    chosen = resolve_placement("cuda", "auto")
    assert chosen.device == torch.device("cuda", 3)
    assert chosen.describe() == "cuda:3, bfloat16 (auto: bf16 on CUDA)"
    assert resolve_placement("auto", "float32").device == torch.device("cuda", 3)
    assert resolve_placement("cpu", "float32").device == torch.device("cpu")  # asked: no GPU


def test_cuda_without_bf16_falls_back_to_float16(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    chosen = resolve_placement("cuda", "auto")
    assert (chosen.device, chosen.dtype) == (torch.device("cuda", 0), torch.float16)
    assert resolve_placement("cuda", "bfloat16").dtype == torch.bfloat16  # asked for: as is


def test_peak_memory_grows_by_a_touched_tensor():
    """In a fresh process (this one's peak may already be higher than anything allocated here):
    a 256 MiB tensor written in full raises the peak by about its size, in bytes (a KiB/bytes
    mix-up would be off by 1024)."""
    size = 256 << 20
    script = ("import torch; from tlt_core.model.placement import peak_memory_bytes as peak\n"
              "cpu = torch.device('cpu'); before = peak(cpu)\n"
              f"x = torch.ones({size // 4}, dtype=torch.float32)  # ones: every page written\n"
              "print(before, peak(cpu))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    before, after = map(int, out.split())
    assert size // 2 <= after - before <= 2 * size, (before, after)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="no /proc/self/clear_refs: the CPU peak cannot be reset here")
def test_reset_peak_memory_forgets_a_freed_tensor():
    """Allocated and freed, 256 MiB still count in the peak until reset_peak_memory, which
    restarts it from what the process holds now (torch returns a tensor that large to the
    system when it is freed)."""
    cpu, size = torch.device("cpu"), 256 << 20
    x = torch.ones(size // 4, dtype=torch.float32)
    del x
    before = peak_memory_bytes(cpu)
    reset_peak_memory(cpu)
    assert before - peak_memory_bytes(cpu) >= size // 2


@pytest.mark.gpu
def test_peak_memory_on_cuda_counts_an_allocation():
    device = torch.device("cuda", torch.cuda.current_device())
    reset_peak_memory(device)
    before = peak_memory_bytes(device)
    x = torch.ones(64 << 20, dtype=torch.uint8, device=device)
    assert peak_memory_bytes(device) - before >= x.nbytes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, the float32 model saved there)."""
    model = tiny_target()
    folder = tmp_path_factory.mktemp("tiny")
    save_checkpoint(model, folder)
    return folder, model


def weights_equal(loaded, model, dtype) -> bool:
    expected = model.state_dict()
    return all(torch.equal(tensor, expected[name].to(dtype))
               for name, tensor in loaded.state_dict().items())


def test_load_checkpoint_defaults_are_float32_on_the_cpu(checkpoint):
    folder, model = checkpoint
    loaded = load_checkpoint(folder)
    assert loaded.lm_head.weight.device == torch.device("cpu")
    assert weights_equal(loaded, model, torch.float32)


@pytest.mark.parametrize("dtype, expected", [
    ("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float64)])  # any torch dtype, as ever
@pytest.mark.parametrize("device", ["cpu", "auto", torch.device("cpu")])
def test_load_checkpoint_takes_placement_names(checkpoint, no_cuda, dtype, expected, device):
    folder, model = checkpoint
    loaded = load_checkpoint(folder, dtype=dtype, device=device)
    assert loaded.lm_head.weight.device == torch.device("cpu")
    assert weights_equal(loaded, model, expected)
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE angles stay fp32


@pytest.mark.parametrize("flag, expected", [("amx_bf16", torch.bfloat16), (None, torch.float32)])
def test_load_checkpoint_auto_dtype_follows_the_cpu(checkpoint, no_cuda, monkeypatch, flag,
                                                    expected):
    monkeypatch.setattr(placement, "cpu_bf16_flag", lambda: flag)
    folder, model = checkpoint
    for device in ("auto", "cpu", torch.device("cpu")):
        assert weights_equal(load_checkpoint(folder, dtype="auto", device=device), model,
                             expected)


@pytest.mark.gpu
def test_load_checkpoint_auto_on_cuda_is_bf16_on_local_rank(checkpoint, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    folder, model = checkpoint
    loaded = load_checkpoint(folder, dtype="auto", device="auto")
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert loaded.lm_head.weight.device == torch.device("cuda", 0)
    assert loaded.lm_head.weight.dtype == expected
    torch.testing.assert_close(loaded.lm_head.weight.cpu(), model.lm_head.weight.to(expected),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype, device, names", [
    ("fp8", "cpu", "dtype"), (None, "cpu", "dtype"), ("float32", "tpu", "device"),
    ("float32", "cuda", "device: cuda"), ("auto", "cuda", "device: cuda")])
def test_load_checkpoint_errors_name_the_argument(checkpoint, no_cuda, dtype, device, names):
    with pytest.raises(ValueError, match=f"^{names}"):
        load_checkpoint(checkpoint[0], dtype=dtype, device=device)
