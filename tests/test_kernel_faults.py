"""Invariant "Bad input gets a clear error, never a crash or a hang", for faults that come from
the process rather than from the arrays: a fork while the CPU thread pool is running, a row that
cannot allocate its scratch, a pool that cannot start its threads, a wrong type code given to
the raw module, and an empty batch (B = 0).

Each scenario runs in a fresh interpreter that loads tlt_core._C by its path (no torch, few
threads), so a crash, an abort or a hang fails one test instead of killing pytest, and resource
limits stay in that interpreter."""

import os
import resource
import subprocess
import sys
import textwrap

import pytest
import torch

import tlt_core.ops as ops
from tlt_core import _C

# Loads the module under test and gives the scripts a greedy verify over NumPy arrays whose
# expected output is known: every node's token is its parent's argmax, so a chain of N nodes
# accepts all N - 1 drafts and emits the argmax of every node.
PRELUDE = textwrap.dedent("""
    import importlib.util, os, sys
    import numpy as np
    spec = importlib.util.spec_from_file_location("tlt_core._C", sys.argv[1])
    _C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_C)
    HOST = -1

    def chain_case(batch, n, vocab, seed=0):
        logits = np.random.default_rng(seed).standard_normal((batch, n, vocab), dtype=np.float32)
        tokens = np.zeros((batch, n), np.int64)
        tokens[:, 1:] = logits[:, :-1].argmax(-1)
        parents = np.arange(-1, n - 1, dtype=np.int32)[None].repeat(batch, 0)
        return logits, tokens, parents

    def greedy(logits, tokens, parents, logits_type=0, device=HOST):
        batch, n, vocab = logits.shape
        accept = np.empty((batch, n), np.int32)
        num_accepted = np.empty(batch, np.int32)
        emitted = np.empty((batch, n), np.int64)
        logprobs = np.empty((batch, n), np.float32)
        status = np.empty(batch, np.int32)
        _C.verify_tree_greedy(logits.ctypes.data, logits_type, tokens.ctypes.data,
                              parents.ctypes.data, 0, batch, n, vocab, accept.ctypes.data,
                              num_accepted.ctypes.data, emitted.ctypes.data,
                              logprobs.ctypes.data, status.ctypes.data, device, 0, 0)
        return emitted, num_accepted, status

    def greedy_is_right(logits, tokens, parents):
        emitted, num_accepted, status = greedy(logits, tokens, parents)
        n = logits.shape[1]
        return ((status == 0).all() and (num_accepted == n - 1).all()
                and (emitted == logits.argmax(-1)).all())

    def vm_bytes():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

    def threads():
        return len(os.listdir("/proc/self/task"))
""")


def run_script(body, timeout, threads=4, preexec_fn=None):
    env = dict(os.environ, TLT_NUM_THREADS=str(threads))
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), _C.__file__],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)


def assert_ran(result):
    assert result.returncode == 0, (
        f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")


def test_forked_children_never_hang_in_their_first_kernel():
    # The parent keeps three threads in kernels while it forks, so some forks land while a
    # worker holds the pool's lock or waits on its condition variable. A child that hangs is
    # killed by its alarm and counted.
    result = run_script("""
        import signal, threading, time
        case = chain_case(8, 4, 64)
        stop = threading.Event()
        errors = []
        def hammer():
            while not stop.is_set():
                if not greedy_is_right(*case):
                    errors.append("wrong result in the parent")
        hammers = [threading.Thread(target=hammer) for _ in range(3)]
        for thread in hammers:
            thread.start()
        children = []
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                signal.alarm(20)
                os._exit(0 if greedy_is_right(*case) and greedy_is_right(*case) else 1)
            children.append(pid)
        stop.set()
        for thread in hammers:
            thread.join()
        failed = []
        for pid in children:
            _, status = os.waitpid(pid, 0)
            if status != 0:
                failed.append(status)
        assert not errors, errors
        assert not failed, f"{len(failed)} of 200 children failed or hung: statuses {failed[:10]}"
        print("ok")
    """, timeout=240)
    assert_ran(result)


def test_row_allocation_failure_is_a_memory_error_and_the_pool_survives():
    # V = 2^22 needs 16 MiB per scratch buffer and a row needs three; the address space is
    # capped 24 MiB above what the process already maps (after the pool's threads exist), so a
    # row's scratch cannot be allocated -- in whichever thread runs it. Once the cap is lifted,
    # the same call must succeed: a half-grown scratch must not pass for a whole one.
    result = run_script("""
        import resource
        small = chain_case(16, 3, 8)
        assert greedy_is_right(*small)
        big = chain_case(4, 2, 1 << 22)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (24 << 20), hard))
        try:
            greedy(*big)
        except MemoryError:
            pass
        else:
            raise AssertionError("the call did not run out of memory")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert greedy_is_right(*big)
        assert greedy_is_right(*small)
        print("ok")
    """, timeout=120)
    assert_ran(result)


def _eight_mib_thread_stacks():
    # glibc sizes a thread's stack by RLIMIT_STACK at start-up; fix it so the cap below bites.
    resource.setrlimit(resource.RLIMIT_STACK, (8 << 20, resource.getrlimit(resource.RLIMIT_STACK)[1]))


def test_pool_that_cannot_start_threads_runs_rows_on_the_caller():
    # The address space is capped 4 MiB above what the process maps before the pool starts, so
    # no 8 MiB worker stack fits: every thread creation fails. Kernels must still give right
    # answers (on the calling thread), now and later.
    result = run_script("""
        import resource
        case = chain_case(16, 5, 32)
        before = threads()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (4 << 20), hard))
        try:
            assert greedy_is_right(*case)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert threads() == before, "a worker thread started: the cap did not bite"
        assert greedy_is_right(*case)
        print("ok")
    """, timeout=120, preexec_fn=_eight_mib_thread_stacks)
    assert_ran(result)


def test_raw_module_rejects_bad_type_codes_and_devices():
    result = run_script("""
        case = chain_case(6, 4, 16)
        batch, n, vocab = case[0].shape
        for code in (3, -1, 7, 2**31 - 1):
            try:
                greedy(*case, logits_type=code)
            except ValueError as error:
                assert "logits_type" in str(error), error
            else:
                raise AssertionError(f"verify_tree_greedy accepted logits_type {code}")
            ones = np.ones(batch, np.float32)
            top_k = np.zeros(batch, np.int32)
            uniforms = np.full((batch, n), 0.5, np.float32)
            outputs = [np.empty((batch, n), np.int32), np.empty(batch, np.int32),
                       np.empty((batch, n), np.int64), np.empty((batch, n), np.float32),
                       np.empty(batch, np.int32)]
            try:
                _C.verify_tree_sampling(case[0].ctypes.data, code, 0, case[1].ctypes.data,
                                        case[2].ctypes.data, 0, ones.ctypes.data,
                                        top_k.ctypes.data, ones.ctypes.data,
                                        uniforms.ctypes.data, batch, n, vocab,
                                        *[o.ctypes.data for o in outputs], 0, HOST, 0, 0)
            except ValueError as error:
                assert "logits_type" in str(error), error
            else:
                raise AssertionError(f"verify_tree_sampling accepted logits_type {code}")
        for device in (-2, -(2**40)):
            try:
                greedy(*case, device=device)
            except ValueError as error:
                assert "device" in str(error), error
            else:
                raise AssertionError(f"device {device} was accepted")
        assert greedy_is_right(*case)
        print("ok")
    """, timeout=120)
    assert_ran(result)


EMPTY_BATCH = textwrap.dedent("""
    # B = 0 with every pointer null: each entry point must return without reading one.
    N, V, M = 4, 16, 5
    _C.select_tree(0, 0, 0, 0, 0, M, N, 0, 0, 0, 0, 0, DEVICE, 0)
    _C.tree_metadata(0, 0, 0, 0, N, 0, 0, 0, 0, DEVICE, 0)
    for code in (0, 1, 2):
        _C.verify_tree_greedy(0, code, 0, 0, 0, 0, N, V, 0, 0, 0, 0, 0, DEVICE, 0, 0)
        _C.verify_tree_sampling(0, code, 0, 0, 0, 0, 0, 0, 0, 0, 0, N, V, 0, 0, 0, 0, 0, 0,
                                DEVICE, 0, 0)
    assert _C.verify_tree_sampling_workspace_bytes(0, V) == 0
    _C.compact_kv(0, 2, 0, 3, 8, 4, 0, 0, 0, N, 0, DEVICE, 0)
    _C.philox_uniforms(0, 0, 0, 7, 0, DEVICE, 0)
    print("ok")
""")


def test_empty_batch_touches_no_pointer_on_the_host():
    assert_ran(run_script("DEVICE = HOST\n" + EMPTY_BATCH, timeout=60))


def test_empty_batch_through_the_public_api():
    n, vocab, m = 4, 16, 5
    chain = torch.arange(-1, n - 1, dtype=torch.int32).repeat(0, 1)  # (0, N)
    logits, tokens = torch.zeros(0, n, vocab), torch.zeros(0, n, dtype=torch.long)
    for out in (ops.verify_tree_greedy(logits, tokens, chain),
                ops.verify_tree_sampling(logits, tokens, chain, temperature=1.0, seed=0)):
        assert out.num_accepted.shape == (0,) and out.emitted_tokens.shape == (0, n)
    assert ops.tree_metadata(chain).depths.shape == (0, n)
    tree = ops.select_tree(torch.zeros(0, m, dtype=torch.long), torch.zeros(0, m),
                           torch.full((0, m), -1, dtype=torch.int32),
                           torch.zeros(0, dtype=torch.long), n)
    assert tree.tokens.shape == (0, n)
    cache = torch.ones(2, 2, 0, 3, 8, 4)  # (layers, K/V, B, H_kv, T, head_dim)
    ops.compact_kv_(cache, torch.zeros(0, n, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                    torch.zeros(0, dtype=torch.int32))
    assert ops.philox_uniforms(torch.zeros(0, dtype=torch.long), 0, 7).shape == (0, 7)


@pytest.mark.gpu
def test_empty_batch_touches_no_pointer_on_cuda():
    if not (_C.built_with_cuda and torch.cuda.is_available()):
        pytest.skip("needs a CUDA build and a CUDA device")
    assert_ran(run_script("DEVICE = 0\n" + EMPTY_BATCH, timeout=120))
