"""Calling tlt_core's fused verification kernels from a NumPy program, and from CuPy, through
DLPack: no torch tensors in the caller's code.

    python examples/dlpack_verify.py                 # NumPy; CuPy too where it can run
    python examples/dlpack_verify.py --batch 64 --nodes 32 --vocab 32000

What it proves (each is an assert; the script exits non-zero when one fails):

1. `verify_tree_greedy` and `verify_tree_sampling` (with explicit uniforms) take NumPy arrays
   and give NumPy arrays back, and their results equal the pure-PyTorch oracle
   `tlt_core.ops.reference` on the same inputs: accepted paths, accepted counts and emitted
   tokens exactly, emitted log-probs to 1e-5.
2. What is and is not copied, checked rather than claimed:
   - the logits, the big input, are viewed in place: the op layer's torch view of a float32
     C-contiguous NumPy array has the array's own data pointer (`torch.from_numpy`);
   - `compact_kv_` on a NumPy KV cache moves entries inside the caller's own buffer (the
     kernel writes through the view);
   - results come back as NumPy arrays that wrap the kernel's output buffers (`.base` is the
     torch tensor the kernel wrote): no copy on the way out;
   - not zero-copy: small integer metadata (tokens, parents, num_nodes) of another integer
     dtype is converted (a B x N copy); float64 logits (NumPy's default dtype) are rejected
     with a TypeError and non-contiguous logits with a ValueError, never copied silently.
3. CuPy (only where `import cupy` works, a CUDA device is usable and tlt_core was built with
   its CUDA kernels; otherwise skipped with the reason printed): the same calls on CuPy arrays
   run the CUDA kernels on the caller's device, give CuPy arrays back that share memory with
   the kernel's outputs, and agree with the CPU results bit for bit on integer outputs.

Notation: B rows, N tree nodes, V vocabulary; a draft tree is tokens[B, N] and parents[B, N]
with node 0 the root and parents[b, i] < i.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
import torch

import tlt_core.ops as ops
from tlt_core.ops import _arrays, reference


@dataclass(frozen=True)
class NumpyTree:
    logits: np.ndarray  # (B, N, V) float32: the target's logits at every node
    tokens: np.ndarray  # (B, N) int64
    parents: np.ndarray  # (B, N) int32
    num_nodes: np.ndarray  # (B,) int32


def random_tree(rng: np.random.Generator, batch: int, nodes: int, vocab: int) -> NumpyTree:
    """Random ragged trees whose logits favour one child's token at most nodes (so several
    tokens get accepted), siblings with distinct tokens (as `select_tree` makes them)."""
    if vocab < nodes:
        raise ValueError(f"vocab: need at least as many tokens as nodes ({nodes}), got {vocab}")
    parents = np.full((batch, nodes), -1, dtype=np.int32)  # (B, N)
    tokens = np.zeros((batch, nodes), dtype=np.int64)  # (B, N)
    num_nodes = rng.integers(1, nodes + 1, size=batch).astype(np.int32)  # (B,)
    logits = (rng.standard_normal((batch, nodes, vocab)) * 2).astype(np.float32)  # (B, N, V)
    for b in range(batch):
        tokens[b, 0] = rng.integers(vocab)
        used: dict[int, set] = {}
        for i in range(1, int(num_nodes[b])):
            parent = int(rng.integers(0, i))
            siblings = used.setdefault(parent, set())
            token = int(rng.choice([t for t in range(vocab) if t not in siblings]))
            siblings.add(token)
            parents[b, i], tokens[b, i] = parent, token
            if rng.random() < 0.7:
                logits[b, parent, token] += 6.0
    return NumpyTree(logits, tokens, parents, num_nodes)


def _as_torch(tree: NumpyTree) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(a)
                 for a in (tree.logits, tree.tokens, tree.parents, tree.num_nodes))


def check_numpy(tree: NumpyTree, uniforms: np.ndarray, temperature: np.ndarray,
                top_p: np.ndarray) -> dict:
    """Both verifiers on NumPy arrays against the reference; returns what was measured."""
    logits_t, tokens_t, parents_t, num_nodes_t = _as_torch(tree)

    greedy = ops.verify_tree_greedy(tree.logits, tree.tokens, tree.parents, tree.num_nodes)
    want = reference.verify_tree_greedy(logits_t, tokens_t, parents_t, num_nodes_t)
    _assert_same(greedy, want, "verify_tree_greedy")

    sampled = ops.verify_tree_sampling(tree.logits, tree.tokens, tree.parents,
                                       temperature=temperature, top_p=top_p, uniforms=uniforms,
                                       num_nodes=tree.num_nodes)
    want_sampled = reference.verify_tree_sampling(
        logits_t, tokens_t, parents_t, torch.from_numpy(temperature), 0, torch.from_numpy(top_p),
        torch.from_numpy(uniforms), num_nodes=num_nodes_t)
    _assert_same(sampled, want_sampled, "verify_tree_sampling")

    for name, value in vars(sampled).items():
        assert isinstance(value, np.ndarray), f"{name}: expected a NumPy array back"
        # tensor.numpy() wraps the tensor's buffer; the array's base is that tensor
        assert isinstance(value.base, torch.Tensor), f"{name}: was copied on the way out"
    return {"greedy_num_accepted": greedy.num_accepted.tolist(),
            "sampled_num_accepted": sampled.num_accepted.tolist(),
            "greedy": greedy, "sampled": sampled}


def _assert_same(got: ops.VerifyOutput, want: reference.VerifyOutput, what: str) -> None:
    for name in ("accept_index", "num_accepted", "emitted_tokens"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name).numpy(),
                                      err_msg=f"{what}: {name} differs from the reference")
    np.testing.assert_allclose(got.emitted_logprobs, want.emitted_logprobs.numpy(), atol=1e-5,
                               err_msg=f"{what}: emitted_logprobs differ from the reference")


def check_copies(tree: NumpyTree, verdict: ops.VerifyOutput, rng: np.random.Generator) -> dict:
    """What the op layer views in place and what it converts or refuses."""
    # 1. the logits are viewed, not copied: the same data pointer
    view = _arrays.as_tensor(tree.logits, "logits")
    assert view.data_ptr() == tree.logits.ctypes.data, "logits were copied"

    # 2. compact_kv_ writes into the caller's NumPy cache: (layers, 2, B, H_kv, T, d), node i of
    # row b at slot cache_len[b] + i, the accepted path moved to cache_len[b] + j
    batch, nodes = tree.parents.shape
    cache_len = rng.integers(0, 4, size=batch).astype(np.int32)  # (B,)
    slots = int(cache_len.max()) + nodes
    cache = rng.standard_normal((2, 2, batch, 2, slots, 4)).astype(np.float32)
    before = cache.copy()
    returned = ops.compact_kv_(cache, verdict.accept_index, verdict.num_accepted, cache_len)
    assert returned is cache, "compact_kv_ returns the caller's array"
    moved = 0
    for b in range(batch):
        for j in range(int(verdict.num_accepted[b]) + 1):
            source = cache_len[b] + verdict.accept_index[b, j]
            np.testing.assert_array_equal(cache[:, :, b, :, cache_len[b] + j],
                                          before[:, :, b, :, source])
            moved += int(source != cache_len[b] + j)

    # 3. what is converted or refused
    tokens32 = tree.tokens.astype(np.int32)  # another integer dtype: converted, a B x N copy
    out = ops.verify_tree_greedy(tree.logits, tokens32, tree.parents, tree.num_nodes)
    np.testing.assert_array_equal(out.emitted_tokens, verdict.emitted_tokens)
    refused = {}
    candidates = {"float64 logits": tree.logits.astype(np.float64)}
    fortran = np.asfortranarray(tree.logits)
    if not fortran.flags.c_contiguous:  # only trivial shapes are both
        candidates["non-contiguous logits"] = fortran
    for label, bad in candidates.items():
        try:
            ops.verify_tree_greedy(bad, tree.tokens, tree.parents, tree.num_nodes)
        except (TypeError, ValueError) as error:
            refused[label] = f"{type(error).__name__}: {error}"
        else:
            raise AssertionError(f"{label} were accepted; expected a clear error, not a copy")
    return {"cache_entries_moved": moved, "refused": refused}


def check_cupy(tree: NumpyTree, uniforms: np.ndarray, temperature: np.ndarray,
               top_p: np.ndarray, cpu: dict) -> str:
    """The same calls on CuPy arrays; returns 'ok' or why the check was skipped."""
    try:
        import cupy
    except ImportError as error:
        return f"skipped: CuPy does not import ({error})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "skipped: CuPy imports but sees no CUDA device"
    except Exception as error:  # noqa: BLE001 - any CUDA runtime failure means no usable device
        return f"skipped: CuPy imports but no CUDA device is usable ({error})"
    if not ops.built_with_cuda:
        return "skipped: tlt_core was built without its CUDA kernels"
    logits, tokens, parents, num_nodes = (cupy.asarray(a) for a in
                                          (tree.logits, tree.tokens, tree.parents, tree.num_nodes))
    view = _arrays.as_tensor(logits, "logits")  # torch.from_dlpack: the same device memory
    assert view.is_cuda and view.data_ptr() == logits.data.ptr, "CuPy logits were copied"
    greedy = ops.verify_tree_greedy(logits, tokens, parents, num_nodes)
    sampled = ops.verify_tree_sampling(logits, tokens, parents,
                                       temperature=cupy.asarray(temperature),
                                       top_p=cupy.asarray(top_p), uniforms=cupy.asarray(uniforms),
                                       num_nodes=num_nodes)
    for got, want, what in ((greedy, cpu["greedy"], "greedy"),
                            (sampled, cpu["sampled"], "sampling")):
        for name in ("accept_index", "num_accepted", "emitted_tokens"):
            value = getattr(got, name)
            assert isinstance(value, cupy.ndarray), f"{what}.{name}: expected a CuPy array"
            # Integer outputs agree bit for bit, except where a uniform lies within float
            # rounding of a decision threshold (README, "Randomness"); none does here.
            np.testing.assert_array_equal(cupy.asnumpy(value), getattr(want, name),
                                          err_msg=f"CUDA {what}: {name} differs from the CPU")
        np.testing.assert_allclose(cupy.asnumpy(got.emitted_logprobs), want.emitted_logprobs,
                                   atol=1e-5)
    return "ok"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="rows B (default 8)")
    parser.add_argument("--nodes", type=int, default=12, help="tree nodes N per row (default 12)")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary V (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cupy", action="store_true", help="skip the CuPy part")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    tree = random_tree(rng, args.batch, args.nodes, args.vocab)
    uniforms = rng.random((args.batch, args.nodes), dtype=np.float32)  # (B, N) in [0, 1)
    temperature = rng.choice(np.array([0.0, 0.7, 1.0], dtype=np.float32), size=args.batch)  # (B,)
    top_p = rng.choice(np.array([1.0, 0.9], dtype=np.float32), size=args.batch)  # (B,)

    cpu = check_numpy(tree, uniforms, temperature, top_p)
    print(f"NumPy: greedy and sampling verification equal tlt_core.ops.reference on "
          f"{args.batch} rows of {args.nodes}-node trees (V = {args.vocab})")
    print(f"  accepted per row, greedy:   {cpu['greedy_num_accepted']}")
    print(f"  accepted per row, sampling: {cpu['sampled_num_accepted']}")
    copies = check_copies(tree, cpu["greedy"], rng)
    print("  logits viewed in place; results wrap the kernel's output buffers; compact_kv_ "
          f"moved {copies['cache_entries_moved']} entries inside the caller's NumPy cache")
    for label, message in copies["refused"].items():
        print(f"  refused, not copied: {label} -> {message}")
    cupy_status = "skipped: --no-cupy" if args.no_cupy else check_cupy(tree, uniforms, temperature,
                                                                      top_p, cpu)
    print(f"CuPy: {cupy_status}")
    return {"greedy_num_accepted": cpu["greedy_num_accepted"],
            "sampled_num_accepted": cpu["sampled_num_accepted"], **copies, "cupy": cupy_status}


if __name__ == "__main__":
    main(sys.argv[1:])
