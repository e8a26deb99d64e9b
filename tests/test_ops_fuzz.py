"""Invariants "Bad input gets a clear error" and "Kernels agree", fuzzed over every public op:
shapes (empty, N = 1), dtypes (every integer and float dtype, bool, complex), values (negative,
2**31, 2**32 + 1, +-2**63, 2**64 - 1, NaN, +-inf, denormals), strides and array kinds (torch,
NumPy), Python numbers of every kind, validate on and off. Each call either returns what
tlt_core.ops.reference computes from the values the op was given, or raises ValueError /
TypeError whose message starts with the name of one of the op's arguments.

Compared when an op returns: its integer outputs (compact_kv_: the cache; philox_uniforms: the
floats, bit for bit) against the reference given the exact values of the inputs (no int32
wrap). With validate=True the reference must also accept the input (an op that accepts what the
oracle rejects has read something else than it was given); with validate=False the op reads no
values, so outputs are compared wherever the reference accepts.

Each op's examples run in one subprocess, so a crash fails that op's test instead of ending the
run, under a time budget: hypothesis in seeded chunks, so the same examples run every time and
only how many chunks fit varies with the machine's speed.

With TLT_FUZZ_SANITIZED_MODULE_DIR set to a folder holding a TLT_SANITIZE=ON build of _C (.ci/run
does), the subprocesses import tlt_core with that _C under ASan + UBSan, so a memory error or
undefined behaviour in a kernel call fails the op's test even where the outputs come out right.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

import tlt_core.ops as ops
from tlt_core.ops import reference
from tlt_core.ops.decoder_layers import DecoderLayers, DecoderShape

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 5.0  # per op; 8 ops plus a ~3 s interpreter start each fit in about a minute
SANITIZED_MODULE_DIR = os.environ.get("TLT_FUZZ_SANITIZED_MODULE_DIR")
CHUNK_EXAMPLES = 50

INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
              torch.uint32, torch.uint64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + [torch.bool, torch.complex64]
SPECIAL_INTS = [-1, 0, 1, 2, -2, 7, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32, 2**32 + 1,
                2**63 - 1, -2**63, 2**64 - 1]
SPECIAL_FLOATS = [0.0, -0.0, 0.5, 1.0, -1.0, 2.0, 1 - 2**-24, 1e-6, 1e-7, 1e-42, 1e-300, 1e300,
                  3e38, math.nan, math.inf, -math.inf]


# ---- the subprocess harness ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("op", ["select_tree", "tree_metadata", "unpack_tree_mask",
                                "verify_tree_greedy", "verify_tree_sampling", "compact_kv_",
                                "philox_uniforms", "rope_kv_write", "add_rms_norm",
                                "panel_matmul", "decode_attention", "silu_mul", "sample_draft",
                                "decoder_layers"])
def test_fuzzed_calls_return_the_reference_or_name_an_argument(op, tmp_path):
    # Run from the repository root, like pytest: `tests` and `tlt_core` import from there.
    script = f"import tests.test_ops_fuzz as f; f.fuzz({op!r})"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if SANITIZED_MODULE_DIR:
        (module,) = Path(SANITIZED_MODULE_DIR).glob("_C*.so")
        script = import_sanitized_package(module, tmp_path) + script
        env.update(sanitizer_env(module))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BUDGET_S + 120)
    if done.returncode < 0:
        how = f"crashed with {signal.Signals(-done.returncode).name}"
    else:
        how = f"failed (exit status {done.returncode})"
    assert done.returncode == 0, f"{op} {how}:\n{done.stdout[-3000:]}\n{done.stderr[-9000:]}"


def import_sanitized_package(module: Path, tmp_path: Path) -> str:
    """Code that makes the subprocess import tlt_core from a copy in tmp_path holding the
    sanitized module, and checks that it did."""
    package = tmp_path / "tlt_core"
    shutil.copytree(ROOT / "tlt_core", package,
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    shutil.copy(module, package / module.name)
    # Ahead of the repository root (sys.path[0]), which stays on the path for `tests`.
    return (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import tlt_core._C as C; "
            f"assert C.__file__ == {str(package / module.name)!r}, C.__file__; ")


def sanitizer_env(module: Path) -> dict:
    """The environment a sanitized module runs in. It links the ASan and UBSan runtimes, but ASan
    must be the first library in the process, so both are preloaded. Leaks go unchecked: the
    interpreter leaks by ASan's standards. A report ends the process with exit status 1 (the
    build has -fno-sanitize-recover)."""
    linked = subprocess.run(["ldd", str(module)], capture_output=True, text=True).stdout
    runtimes = [re.search(rf"=> (\S*/lib{name}\.so[.\d]*)", linked) for name in ("asan", "ubsan")]
    assert all(runtimes), f"{module} does not link the ASan and UBSan runtimes:\n{linked}"
    return {"LD_PRELOAD": ":".join(found.group(1) for found in runtimes),
            "ASAN_OPTIONS": "detect_leaks=0"}


def fuzz(op: str) -> None:
    """Runs op's examples until BUDGET_S is spent (the subprocess's body), in chunks of
    CHUNK_EXAMPLES with seeds 0, 1, 2, ...: hypothesis has no time limit of its own, and each
    seeded chunk is the same on every run."""
    torch.set_num_threads(1)
    deadline = time.monotonic() + BUDGET_S
    tally = {"returned": 0, "raised": 0}

    def example(data):
        tally["returned" if CASES[op](data) else "raised"] += 1

    chunk = 0
    while time.monotonic() < deadline:
        run = settings(max_examples=CHUNK_EXAMPLES, deadline=None, database=None,
                       phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                       report_multiple_bugs=False)(given(st.data())(example))
        seed(chunk)(run)()
        chunk += 1
    print(f"{op}: {tally['returned']} calls returned the reference's outputs, "
          f"{tally['raised']} raised an error naming an argument ({chunk} chunks)")


# ---- building arguments ----------------------------------------------------------------------

def wrap(value: int, dtype: torch.dtype) -> int:
    """value in dtype's range, two's complement (what a C cast would leave)."""
    info = torch.iinfo(dtype)
    return (value - info.min) % (1 << info.bits) + info.min


def tensor_of(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """values (an object array of Python numbers) as a dtype tensor; integer dtypes wrap."""
    flat, shape = values.ravel().tolist(), values.shape
    if dtype in INT_DTYPES:
        flat = [wrap(int(v) if math.isfinite(v) else 0, dtype) for v in flat]
        if dtype == torch.uint64:  # torch.tensor takes no Python int >= 2**63
            return torch.from_numpy(np.array(flat, dtype=np.uint64).reshape(shape))
    elif dtype == torch.bool:
        flat = [bool(v) for v in flat]
    elif dtype.is_complex:
        flat = [complex(v) for v in flat]
    else:
        flat = [float(v) for v in flat]
    return torch.tensor(flat, dtype=dtype).reshape(shape)


def objects(array_like) -> np.ndarray:
    return np.array(array_like, dtype=object)


def draw_array(data, values: np.ndarray, dtype: torch.dtype, specials: list, *,
               dtypes: list = ALL_DTYPES):
    """An array argument holding values in dtype, or (four times in nine) with a special value
    poked in, with a value int32 / int64 truncation would turn into the valid one, in another
    dtype or in another shape; any of them strided or a NumPy array."""
    values = values.copy()
    change = data.draw(st.sampled_from(["none"] * 10 + ["poke"] * 3 + ["alias"] * 2
                                       + ["dtype"] * 2 + ["shape"]))
    if change == "alias" and not (values.size and all(isinstance(v, int) for v in values.flat)):
        change = "none"
    if change in ("poke", "alias") and values.size:
        index = data.draw(st.integers(0, values.size - 1))
        if change == "poke":
            special = data.draw(st.sampled_from(specials))
        else:  # a value that int32 or int64 truncation turns into the valid one
            special = values.reshape(-1)[index]
            special = int(special) + data.draw(st.sampled_from([2**32, -2**32, 2**33, 2**64]))
        values.reshape(-1)[index] = special
        if dtype in INT_DTYPES and isinstance(special, int) and wrap(special, dtype) != special:
            # the narrowest integer dtype that holds it, so that the op is the one to narrow it
            dtype = torch.int64 if wrap(special, torch.int64) == special else torch.uint64
    if change == "dtype":
        dtype = data.draw(st.sampled_from(dtypes))
    tensor = tensor_of(values, dtype)
    if change == "shape":
        how = data.draw(st.sampled_from(["more dims", "fewer dims", "more rows"]))
        if how == "more dims":
            tensor = tensor.unsqueeze(-1)
        elif how == "fewer dims" and tensor.dim() and tensor.shape[-1]:
            tensor = tensor[..., 0]
        elif tensor.dim():
            tensor = torch.cat((tensor, tensor[:1]), 0)
    if tensor.dim() and data.draw(st.integers(0, 5)) == 0:
        wide = torch.zeros(tensor.shape[:-1] + (2 * tensor.shape[-1],), dtype=tensor.dtype)
        wide[..., ::2] = tensor
        tensor = wide[..., ::2]
    if tensor.dtype != torch.bfloat16 and data.draw(st.integers(0, 3)) == 0:
        return tensor.numpy()
    return tensor


def draw_number(data, choices: list):
    """A Python or NumPy number of some type, or something that is not one."""
    value = data.draw(st.sampled_from(choices))
    form = data.draw(st.integers(0, 19))
    if form == 0:
        return bool(value) if not isinstance(value, float) or not math.isnan(value) else True
    if form == 1:
        return complex(value)
    if form == 2 and isinstance(value, int) and -2**63 <= value < 2**63:
        return np.int64(value)
    if form == 3 and isinstance(value, float):
        return np.float32(value) if abs(value) < 3.4e38 or not math.isfinite(value) else value
    if form == 4:
        return float(value)
    return value


def draw_per_row(data, batch: int, choices: list, dtype: torch.dtype, specials: list):
    """A per-row parameter: a number, or a (B,) array of choices."""
    if data.draw(st.booleans()):
        return draw_number(data, choices * 3 + specials)
    values = objects([data.draw(st.sampled_from(choices)) for _ in range(batch)])
    return draw_array(data, values, dtype, specials)


def held(value) -> np.ndarray:
    """The exact values an array argument holds, as Python numbers."""
    array = value.numpy() if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16 \
        else np.asarray(value.float() if isinstance(value, torch.Tensor) else value)
    return array.astype(object)


def is_integer_array(value) -> bool:
    dtype = value.dtype if isinstance(value, torch.Tensor) else torch.from_numpy(
        np.zeros(0, dtype=value.dtype)).dtype
    return dtype in INT_DTYPES


def as_int64(value) -> torch.Tensor:
    """An integer argument's exact values for the reference (int64; beyond it the same in every
    op's semantics, so clamped)."""
    assert is_integer_array(value), f"accepted a non-integer dtype {value.dtype}"
    values = [min(max(int(v), -2**63), 2**63 - 1) for v in held(value).ravel()]
    return torch.tensor(values, dtype=torch.int64).reshape(np.shape(value))


def bits64(value) -> torch.Tensor:
    """A seed's or offset's 64-bit pattern as int64 (random.h reads it as uint64)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        assert is_integer_array(value), f"accepted a non-integer dtype {value.dtype}"
        values = [wrap(int(v), torch.int64) for v in held(value).ravel()]
        return torch.tensor(values, dtype=torch.int64).reshape(np.shape(value))
    return torch.tensor(wrap(int(value), torch.int64))


def as_float32(value, batch: int) -> torch.Tensor:
    """A real per-row parameter as the float32 (B,) the kernel reads."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        values = [float(v) for v in held(value).ravel()]
    else:
        values = [float(value)] * batch
    with np.errstate(over="ignore"):
        return torch.from_numpy(np.array(values, dtype=np.float64).astype(np.float32))


def to_torch(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


# ---- checking a call -------------------------------------------------------------------------

def call(op, *args, **kwargs):
    """(True, outputs) or (False, None) after checking that the error names an argument."""
    try:
        return True, op(*args, **kwargs)
    except (ValueError, TypeError) as error:
        names = "|".join(inspect.signature(op).parameters)
        assert re.match(f"^({names}):", str(error)), \
            f"{type(error).__name__} names no argument of {op.__name__}: {error}"
        return False, None


def oracle(validate: bool, compute):
    """The reference's outputs, or None where it rejects the input; an op that validated and
    accepted must not be given an input the reference rejects."""
    try:
        return compute()
    except ValueError as error:
        assert not validate, f"accepted with validate=True what the reference rejects: {error}"
        return None


def assert_equal(got, want, what: str) -> None:
    got = to_torch(got)
    assert got.dtype == want.dtype and torch.equal(got, want), f"{what}: {got} != {want}"


def random_tree(data, batch: int, n_max: int, ragged: bool) -> tuple[np.ndarray, np.ndarray]:
    """(parents (B, N), num_nodes (B,)) of valid trees, padding nodes -1."""
    parents = np.full((batch, n_max), -1, dtype=object)
    num_nodes = np.full((batch,), n_max, dtype=object)
    shape = data.draw(st.sampled_from(["random", "chain", "star"]))
    for b in range(batch):
        if ragged:
            num_nodes[b] = data.draw(st.integers(1, n_max))
        for i in range(1, num_nodes[b]):
            parents[b, i] = (i - 1 if shape == "chain" else 0 if shape == "star" else
                             data.draw(st.integers(0, i - 1)))
    return parents, num_nodes


# ---- one example per op ----------------------------------------------------------------------

def fuzz_select_tree(data) -> bool:
    batch, m = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6))
    validate = data.draw(st.booleans())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens = objects(torch.randint(0, 50, (batch, m), generator=g).tolist()).reshape(batch, m)
    parents = objects([[data.draw(st.integers(-1, j - 1)) for j in range(m)] for _ in range(batch)])
    scores = objects([[data.draw(st.sampled_from([0.0, -0.5, -1.0, -2.5, -math.inf]))
                       for _ in range(m)] for _ in range(batch)])
    roots = objects(torch.randint(0, 50, (batch,), generator=g).tolist())
    args = (draw_array(data, tokens.reshape(batch, m), torch.int64, SPECIAL_INTS),
            draw_array(data, scores.reshape(batch, m), torch.float32, SPECIAL_FLOATS),
            draw_array(data, parents.reshape(batch, m), torch.int32, SPECIAL_INTS),
            draw_array(data, roots, torch.int64, SPECIAL_INTS),
            draw_number(data, [1, 2, 3, m + 1, m + 2, 1024] + [0, -1, 1025, 2**32 + 1]))
    returned, tree = call(ops.select_tree, *args, validate=validate)
    if returned:
        want = oracle(validate, lambda: reference.select_tree(
            as_int64(args[0]), to_torch(args[1]), as_int64(args[2]), as_int64(args[3]),
            int(args[4])))
        if want is not None:
            for got, expected, what in zip((tree.tokens, tree.parents, tree.source_index,
                                            tree.num_nodes), want, ("tokens", "parents",
                                                                    "source_index", "num_nodes")):
                assert_equal(got, expected, what)
    return returned


def fuzz_tree_metadata(data) -> bool:
    batch, n_max = data.draw(st.integers(0, 3)), data.draw(st.sampled_from([1, 2, 3, 5, 33]))
    validate = data.draw(st.booleans())
    parents, num_nodes = random_tree(data, batch, n_max, ragged=data.draw(st.booleans()))
    parents_arg = draw_array(data, parents, torch.int32, SPECIAL_INTS + [n_max])
    num_nodes_arg = (None if data.draw(st.booleans()) else
                     draw_array(data, num_nodes, torch.int32, SPECIAL_INTS + [n_max + 1]))
    cache_len = objects([data.draw(st.integers(0, 100)) for _ in range(batch)])
    cache_len_arg = (None if data.draw(st.booleans()) else
                     draw_array(data, cache_len, torch.int64, SPECIAL_INTS))
    returned, meta = call(ops.tree_metadata, parents_arg, num_nodes_arg, cache_len_arg,
                          validate=validate)
    if returned:
        want = oracle(validate, lambda: reference.tree_metadata(
            as_int64(parents_arg), None if num_nodes_arg is None else as_int64(num_nodes_arg),
            None if cache_len_arg is None else as_int64(cache_len_arg)))
        if want is not None:
            for got, expected, what in zip((meta.depths, meta.positions, meta.mask), want,
                                           ("depths", "positions", "mask")):
                assert_equal(got, expected, what)
    return returned


def fuzz_unpack_tree_mask(data) -> bool:
    batch, n_max = data.draw(st.integers(0, 3)), data.draw(st.sampled_from([1, 2, 5, 32, 33]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    words = torch.randint(-2**31, 2**31, (batch, n_max, (n_max + 31) // 32), generator=g)
    mask = draw_array(data, objects(words.tolist()).reshape(words.shape), torch.int32,
                      SPECIAL_INTS, dtypes=ALL_DTYPES + [torch.uint32] * 3)
    num_nodes_max = draw_number(data, [n_max] * 4 + [0, 1, 1025, 2**32 + 1])
    returned, unpacked = call(ops.unpack_tree_mask, mask, num_nodes_max)
    if returned:
        want = oracle(True, lambda: reference.unpack_tree_mask(as_int64(mask), int(num_nodes_max)))
        assert_equal(unpacked, want, "unpacked mask")
    return returned


VERIFY_ISAS = ["auto", "portable"]  # the CPU verifier's AVX2 passes over V and its scalar loops


def verify_case(data):
    """A random verification problem: logits, tokens, parents and num_nodes arguments."""
    batch, n_max = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 5))
    vocab = data.draw(st.sampled_from([1, 2, 5, 8, 13, 37]))  # the AVX2 passes' blocks and tails
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    parents, num_nodes = random_tree(data, batch, n_max, ragged=data.draw(st.booleans()))
    tokens = torch.randint(0, vocab, (batch, n_max), generator=g)
    logits = torch.randn(batch, n_max, vocab, generator=g) * data.draw(st.sampled_from([0, 1, 4]))
    for b in range(batch):  # make acceptance likely along some edges
        for i in range(1, n_max):
            if parents[b, i] >= 0 and float(torch.rand(1, generator=g)) < 0.6:
                logits[b, parents[b, i], tokens[b, i]] += 5.0
    logits_arg = draw_array(data, objects(logits.tolist()).reshape(logits.shape), torch.float32,
                            SPECIAL_FLOATS, dtypes=FLOAT_DTYPES * 3 + ALL_DTYPES)
    tokens_arg = draw_array(data, objects(tokens.tolist()).reshape(tokens.shape), torch.int64,
                            SPECIAL_INTS + [vocab])
    parents_arg = draw_array(data, parents, torch.int32, SPECIAL_INTS + [n_max])
    num_nodes_arg = (None if data.draw(st.booleans()) else
                     draw_array(data, num_nodes, torch.int32, SPECIAL_INTS + [n_max + 1]))
    return (batch, n_max, vocab, g), (logits_arg, tokens_arg, parents_arg, num_nodes_arg)


def reference_tree(args):
    logits, tokens, parents, num_nodes = args
    return (to_torch(logits), as_int64(tokens), as_int64(parents),
            None if num_nodes is None else as_int64(num_nodes))


def assert_same_verdict(got, want) -> None:
    for name in ("accept_index", "num_accepted", "emitted_tokens"):
        assert_equal(getattr(got, name), getattr(want, name), name)


def fuzz_verify_tree_greedy(data) -> bool:
    _, args = verify_case(data)
    validate = data.draw(st.booleans())
    returned, verdict = call(ops.verify_tree_greedy, *args, validate=validate,
                             isa=data.draw(st.sampled_from(VERIFY_ISAS)))
    if returned:
        want = oracle(validate, lambda: reference.verify_tree_greedy(*reference_tree(args)))
        if want is not None:
            assert_same_verdict(verdict, want)
    return returned


def fuzz_verify_tree_sampling(data) -> bool:
    (batch, n_max, vocab, g), args = verify_case(data)
    validate = data.draw(st.booleans())
    temperature = draw_per_row(data, batch, [0.0, 1e-6, 0.5, 1.0, 2.0, 1], torch.float32,
                               SPECIAL_FLOATS + [-1])
    top_k = draw_per_row(data, batch, [0, 1, 2, vocab, vocab + 1, -1], torch.int32,
                         SPECIAL_INTS + [2.5])
    top_p = draw_per_row(data, batch, [1.0, 0.9, 0.5, 1e-6, 1], torch.float32, SPECIAL_FLOATS)
    kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    if data.draw(st.booleans()):
        uniforms = torch.rand(batch, n_max, generator=g)
        kwargs["uniforms"] = draw_array(data, objects(uniforms.tolist()).reshape(uniforms.shape),
                                        torch.float32, SPECIAL_FLOATS + [1.0, 1 + 2**-23])
    else:
        kwargs["seed"] = draw_per_row(data, batch, [0, 1, 12345], torch.int64, SPECIAL_INTS)
        if data.draw(st.booleans()):
            kwargs["offset"] = draw_per_row(data, batch, [0, 3, 2**40], torch.int64, SPECIAL_INTS)
    if data.draw(st.booleans()):
        q = torch.softmax(torch.randn(batch, n_max, vocab, generator=g) * 2, -1)
        kwargs["draft_probs"] = draw_array(data, objects(q.tolist()).reshape(q.shape),
                                           torch.float32, SPECIAL_FLOATS + [-0.5, 1.5])
    returned, verdict = call(ops.verify_tree_sampling, *args[:3], num_nodes=args[3],
                             validate=validate, isa=data.draw(st.sampled_from(VERIFY_ISAS)),
                             **kwargs)
    if returned:
        if validate:  # a positive parameter must not reach the kernel as 0 (float32 rounding)
            for name in ("temperature", "top_p"):
                given = held(kwargs[name]) if isinstance(kwargs[name], (torch.Tensor, np.ndarray)) \
                    else objects([kwargs[name]] * batch)
                rounded = as_float32(kwargs[name], batch)
                assert all(float(v) == 0 or r != 0 for v, r in zip(given.ravel(), rounded)), name
        want = oracle(validate, lambda: reference.verify_tree_sampling(
            *reference_tree(args)[:3], as_float32(temperature, batch),
            (as_int64(top_k) if isinstance(top_k, (torch.Tensor, np.ndarray)) else
             torch.tensor(max(min(int(top_k), 2**63 - 1), -2**63)).expand(batch)),
            as_float32(top_p, batch), reference_uniforms(kwargs, batch, n_max),
            draft_probs=(None if "draft_probs" not in kwargs else
                         to_torch(kwargs["draft_probs"])),
            num_nodes=reference_tree(args)[3]))
        if want is not None:
            assert_same_verdict(verdict, want)
    return returned


def reference_uniforms(kwargs: dict, batch: int, n_max: int) -> torch.Tensor:
    if "uniforms" in kwargs:
        return to_torch(kwargs["uniforms"])
    seeds = bits64(kwargs["seed"]).expand(batch)
    offsets = bits64(kwargs.get("offset", 0)).expand(batch)
    return reference.philox_uniforms(seeds.contiguous(), offsets.contiguous(), n_max)


def fuzz_compact_kv_(data) -> bool:
    planes, batch, groups = (data.draw(st.integers(1, 2)), data.draw(st.integers(0, 3)),
                             data.draw(st.integers(1, 2)))
    max_len, entry = data.draw(st.integers(0, 7)), data.draw(st.integers(1, 2))
    n_max = data.draw(st.integers(1, 4))
    validate = data.draw(st.booleans())
    token_major = data.draw(st.booleans())
    shape = (planes, batch, max_len, entry) if token_major else (planes, batch, groups, max_len,
                                                                  entry)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.int8, torch.bool,
                                       torch.complex64, torch.int64]))
    cache = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    if data.draw(st.integers(0, 9)) == 0:
        cache = cache.transpose(0, -1)
    dims = data.draw(st.sampled_from(
        [(-3, -2), (1, 2)] if token_major else [(-4, -2), (1, 3), (1, -2)]))
    if data.draw(st.integers(0, 9)) == 0:  # the same dims in another type, or out of range
        dims = (draw_number(data, [dims[0], 9, -9]), draw_number(data, [dims[1], 9, -9]))
    accept, accepted, cache_len = [], [], []
    for _ in range(batch):
        count = data.draw(st.integers(1, n_max))
        path = sorted(data.draw(st.sets(st.integers(1, n_max - 1), min_size=count - 1,
                                        max_size=count - 1))) if count > 1 else []
        accept.append([0] + path + [-1] * (n_max - count))
        accepted.append(count - 1)
        cache_len.append(data.draw(st.integers(0, max(max_len - 1, 0))))
    accept_arg = draw_array(data, objects(accept).reshape(batch, n_max), torch.int32,
                            SPECIAL_INTS + [n_max])
    accepted_arg = draw_array(data, objects(accepted), torch.int32, SPECIAL_INTS + [n_max])
    cache_len_arg = draw_array(data, objects(cache_len), torch.int32, SPECIAL_INTS + [max_len])
    before = cache.clone()
    if data.draw(st.integers(0, 4)) == 0 and cache.is_contiguous() and dtype != torch.bfloat16:
        cache = cache.numpy()
    returned, _ = call(ops.compact_kv_, cache, accept_arg, accepted_arg, cache_len_arg,
                       batch_dim=dims[0], seq_dim=dims[1], validate=validate)
    if not returned:
        assert_equal(cache, before, "cache after an error")
        return False
    want = before.clone()
    status = oracle(validate, lambda: reference.compact_kv_(
        want if not token_major else want.unsqueeze(2), as_int64(accept_arg),
        as_int64(accepted_arg), as_int64(cache_len_arg)))
    if status is not None:
        assert not validate or not bool(status.any()), f"accepted bad rows: {status}"
        assert_equal(cache, want, "compacted cache")
    return True


def fuzz_philox_uniforms(data) -> bool:
    batch = data.draw(st.integers(0, 3))
    seeds = objects([data.draw(st.sampled_from(SPECIAL_INTS + [12345])) for _ in range(batch)])
    seeds_arg = draw_array(data, seeds, torch.int64, SPECIAL_INTS)
    offsets = draw_per_row(data, batch, [0, 5, 2**33, -5], torch.int64, SPECIAL_INTS + [2**64])
    count = draw_number(data, [0, 1, 2, 5, 33] * 2 + [-1, 2**31, 2**32 + 1, -2**63])
    returned, uniforms = call(ops.philox_uniforms, seeds_arg, offsets, count)
    if returned:
        rows = np.shape(seeds_arg)[0]
        want = oracle(True, lambda: reference.philox_uniforms(
            bits64(seeds_arg), bits64(offsets).expand(rows).contiguous(), int(count)))
        assert_equal(uniforms, want, "uniforms")
    return returned


def fuzz_rope_kv_write(data) -> bool:
    batch, tokens = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    q_heads, kv_heads = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    d, slots_len, table_len = (data.draw(st.sampled_from([2, 4, 8, 16, 32])),
                               data.draw(st.integers(0, 6)), data.draw(st.integers(0, 6)))
    model_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    cache_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    shape = (batch, tokens, q_heads + 2 * kv_heads, d)
    qkv = draw_array(data, objects(torch.randn(shape, generator=g).tolist()).reshape(shape),
                     model_dtype, SPECIAL_FLOATS, dtypes=FLOAT_DTYPES * 3 + ALL_DTYPES)
    tables = [draw_array(data, objects(torch.randn(table_len, d, generator=g).tolist())
                         .reshape(table_len, d), model_dtype, SPECIAL_FLOATS,
                         dtypes=FLOAT_DTYPES * 3 + ALL_DTYPES) for _ in range(2)]
    indices = []
    for bound in (table_len, slots_len):
        values = torch.randint(0, max(bound, 1), (batch, tokens), generator=g)
        indices.append(draw_array(data, objects(values.tolist()).reshape(batch, tokens),
                                  torch.int64, SPECIAL_INTS + [bound]))
    cache = torch.randn(2, batch + 1, kv_heads, slots_len, d, generator=g).to(cache_dtype)
    cache = cache[:, :batch]
    q_out = torch.empty(batch, q_heads, tokens, d, dtype=data.draw(st.sampled_from(
        [cache_dtype] * 5 + [torch.float16, torch.int32])))
    before = cache.clone()
    returned, _ = call(ops.rope_kv_write, qkv, *tables, *indices, cache, q_out)
    if not returned:
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8)), \
            "cache written before an error"
        return False
    want_q = torch.empty_like(q_out)
    oracle(True, lambda: reference.rope_kv_write(qkv, *tables, *indices, before, want_q))
    torch.testing.assert_close(q_out, want_q, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cache, before, rtol=0, atol=0, equal_nan=True)
    return True


def fuzz_add_rms_norm(data) -> bool:
    rows, hidden = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    float_dtypes = [torch.bfloat16] * 9 + ALL_DTYPES

    def tensor(shape, scale):
        values = objects((torch.randn(shape, generator=g) * scale).tolist()).reshape(shape)
        return draw_array(data, values, torch.bfloat16, SPECIAL_FLOATS, dtypes=float_dtypes)

    h = tensor((rows, hidden), 3.0)
    delta = tensor((rows, hidden), 1.0) if data.draw(st.booleans()) else None
    weight = tensor((hidden,), 1.0)
    eps = draw_number(data, [1e-5, 1e-6, 0.0, 1.0, -1e-5, math.nan, math.inf])
    inputs = [t.clone() for t in (h, delta, weight) if isinstance(t, torch.Tensor)]
    returned, outputs = call(ops.add_rms_norm, h, delta, weight, eps)
    for before, after in zip(inputs, [t for t in (h, delta, weight)
                                      if isinstance(t, torch.Tensor)]):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    if not returned:
        return False
    want = reference.add_rms_norm(h, delta, weight, float(eps))
    for got, expected, name in zip(outputs, want, ("h_out", "normed")):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=name)
    return True


def fuzz_panel_matmul(data) -> bool:
    # up to 20 rows: one group of 1-3 rows across panels, or groups of 4-6 down one panel and a
    # rest; in bfloat16 pairs, one group of up to 12, or groups of 8 and a rest; up to 5 panels,
    # so blocks of 1-4 and, from 5 rows, the next block prefetched
    rows, out_features = data.draw(st.integers(0, 20)), data.draw(st.integers(1, 80))
    in_features = data.draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    pairs = dtype == torch.bfloat16 and data.draw(st.booleans())
    float_dtypes = [dtype] * 9 + ALL_DTYPES

    def tensor(values):
        return draw_array(data, objects(values.tolist()).reshape(values.shape), dtype,
                          SPECIAL_FLOATS, dtypes=float_dtypes)

    panels = ops.pack_panels(torch.randn(out_features, in_features, generator=g).to(dtype),
                             pairs=pairs)
    x = tensor(torch.randn(rows, in_features, generator=g))
    if data.draw(st.integers(0, 3)) == 0:  # mostly the pack as made: x and N vary more
        panels = tensor(panels)
    bias = tensor(torch.randn(out_features, generator=g)) if data.draw(st.booleans()) else None
    addend = (tensor(torch.randn(rows, out_features, generator=g))
              if data.draw(st.booleans()) else None)
    N = draw_number(data, [out_features] * 20 + [0, -1, out_features + 16, 2**31])
    args = [x, panels, N, bias, addend]
    inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    returned, y = call(ops.panel_matmul, *args)
    for before, after in zip(inputs, args):  # never written
        if isinstance(after, torch.Tensor):
            torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    if not returned:
        return False
    want = reference.panel_matmul(x, panels, int(N), bias, addend)
    if y.dtype == torch.bfloat16:  # every bit, NaNs' included (0x7FC0)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    else:
        torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)
    return True


def fuzz_decode_attention(data) -> bool:
    batch, kv_heads = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 2))
    q_heads = kv_heads * data.draw(st.integers(1, 3)) + data.draw(st.sampled_from([0] * 9 + [1]))
    tokens, d = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([1, 3, 8, 16]))
    max_len = data.draw(st.integers(1, 80))  # past 64 slots: a second chunk
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    # q and the cache share a dtype: float32, or a bf16 model's bfloat16 (widened in the kernel)
    kv_dtype = data.draw(st.sampled_from([torch.float32] * 3 + [torch.bfloat16]))
    float_dtypes = [kv_dtype] * 9 + ALL_DTYPES

    def tensor(shape):
        values = objects(torch.randn(shape, generator=g).tolist()).reshape(shape)
        array = draw_array(data, values, kv_dtype, SPECIAL_FLOATS, dtypes=float_dtypes)
        # mostly a torch tensor, the only kind this op takes: its checks past the first run
        if isinstance(array, np.ndarray) and data.draw(st.integers(0, 3)):
            array = torch.from_numpy(array)
        return array

    q = tensor((batch, q_heads, tokens, d))
    cache = tensor((2, batch + 1, kv_heads, max_len, d))
    if isinstance(cache, torch.Tensor) and cache.dim() == 5 and data.draw(st.booleans()):
        cache = cache[:, :batch]  # the engine's running rows: a strided view
    slots = draw_number(data, [max_len] * 12 + [1, max(max_len // 2, 1)] * 3 + [0, max_len + 1, -1])
    mask = None
    if data.draw(st.booleans()):
        shape = (data.draw(st.sampled_from([batch, 1])), 1, data.draw(st.sampled_from([tokens, 1])),
                 slots if isinstance(slots, int) and 0 < slots < 200 else 1)
        mask = torch.rand(shape, generator=g) < data.draw(st.sampled_from([0.0, 0.5, 1.0]))
        if data.draw(st.integers(0, 9)) == 0:
            mask = mask.float()
    out_dtype = data.draw(st.sampled_from([torch.float32] * 4 + [torch.bfloat16] * 4
                                          + [torch.float16, torch.int32]))
    args = [q, cache, slots, mask, out_dtype]
    inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    returned, out = call(ops.decode_attention, *args)
    for before, after in zip(inputs, args):  # never written
        if isinstance(after, torch.Tensor):
            torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    if not returned:
        return False
    # q's own shape: a drawn shape may add rows, valid where the cache has them too
    rows, heads, tokens, d = q.shape
    assert out.shape == (rows * tokens, heads * d) and out.dtype == out_dtype
    # finite inputs of a moderate size: the float64 math to float32 rounding (past that, the
    # header promises non-finite outputs for the queries they reach, not which)
    if all(t.numel() == 0 or (bool(t.isfinite().all()) and float(t.abs().max()) < 1e3)
           for t in (q, cache)):
        want = reference.decode_attention(q, cache, int(slots), mask)
        tolerance = 1e-5 if out_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)
    return True


def fuzz_silu_mul(data) -> bool:
    rows, width = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 20))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    values = objects((torch.randn(rows, 2 * width, generator=g) * 4).tolist())
    gate_up = draw_array(data, values.reshape(rows, 2 * width), dtype, SPECIAL_FLOATS,
                         dtypes=[dtype] * 9 + ALL_DTYPES)
    if isinstance(gate_up, np.ndarray) and data.draw(st.integers(0, 3)):
        gate_up = torch.from_numpy(gate_up)  # mostly a torch tensor, the only kind it takes
    before = gate_up.clone() if isinstance(gate_up, torch.Tensor) else None
    returned, out = call(ops.silu_mul, gate_up)
    if before is not None:  # never written
        torch.testing.assert_close(gate_up, before, rtol=0, atol=0, equal_nan=True)
    if not returned:
        return False
    want = reference.silu_mul(gate_up)
    assert out.dtype == gate_up.dtype and out.shape == want.shape
    assert torch.equal(out.isnan(), want.isnan()), "NaNs where the math has none, or none"
    finite = want.isfinite() & (want.abs() < 3e38)
    place = 2e-6 if out.dtype == torch.float32 else 8e-3  # a few ulps / one bf16 place
    torch.testing.assert_close(out.double()[finite], want[finite], rtol=place, atol=1e-37)
    return True


def fuzz_sample_draft(data) -> bool:
    rows, draft_vocab = data.draw(st.integers(0, 3)), data.draw(st.sampled_from([1, 3, 8, 13]))
    draws = data.draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))

    def tensor_arg(values, shape, specials):
        arg = draw_array(data, objects(values.tolist()).reshape(shape), torch.float32, specials,
                         dtypes=[torch.float32] * 9 + ALL_DTYPES)
        if isinstance(arg, np.ndarray) and data.draw(st.integers(0, 3)):
            arg = torch.from_numpy(arg)  # mostly a torch tensor, the only kind it takes
        return arg

    logits = tensor_arg(torch.randn(rows, draft_vocab, generator=g) * 3, (rows, draft_vocab),
                        SPECIAL_FLOATS)
    uniforms = tensor_arg(torch.rand(rows, draws, generator=g), (rows, draws),
                          SPECIAL_FLOATS + [1 - 2**-24])
    temperature = tensor_arg(torch.tensor([0.0, 0.7, 1.0, 2.0])[:rows], (rows,),
                             SPECIAL_FLOATS + [-1.0])
    mapped = data.draw(st.booleans())
    vocab = draft_vocab + data.draw(st.integers(0, 5)) if mapped else None
    ids_map = (torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
               if mapped else None)
    returned, out = call(ops.sample_draft, logits, uniforms, temperature, ids_map, vocab)
    if not returned:
        return False
    ids, q = out
    want_ids, want_q = reference.sample_draft(logits, uniforms, temperature, ids_map, vocab)
    assert torch.equal(ids, want_ids), f"ids: {ids} != {want_ids}"
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-9)
    return True


def fuzz_decoder_layers(data) -> bool:
    from tests.test_decoder_layers import one_by_one, random_layers

    batch, tokens, num_layers = (data.draw(st.integers(0, 2)), data.draw(st.integers(1, 3)),
                                 data.draw(st.integers(1, 2)))
    kv_heads = data.draw(st.integers(1, 2))
    shape = DecoderShape(hidden=data.draw(st.integers(1, 24)),
                         q_heads=kv_heads * data.draw(st.integers(1, 2)), kv_heads=kv_heads,
                         head_dim=data.draw(st.sampled_from([2, 4, 8, 16])),
                         intermediate=data.draw(st.integers(1, 12)))
    max_len, table_len = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    layers = random_layers(shape, num_layers, g, pairs=data.draw(st.booleans()),
                           bias=data.draw(st.booleans()))
    if data.draw(st.booleans()):  # Qwen3's per-head q and k norms
        layers = [dataclasses.replace(
            layer, q_norm=torch.randn(shape.head_dim, generator=g).to(torch.bfloat16),
            k_norm=torch.randn(shape.head_dim, generator=g).to(torch.bfloat16), qk_eps=1e-6)
            for layer in layers]
    kernel = DecoderLayers(shape, layers)

    def tensor(values: torch.Tensor, dtype: torch.dtype, specials: list):
        array = draw_array(data, objects(values.tolist()).reshape(values.shape), dtype, specials,
                           dtypes=[dtype] * 9 + ALL_DTYPES)
        if isinstance(array, np.ndarray) and data.draw(st.integers(0, 3)):
            array = torch.from_numpy(array)  # mostly a torch tensor, the only kind it takes
        return array

    h = tensor(torch.randn(batch * tokens, shape.hidden, generator=g), torch.bfloat16,
               SPECIAL_FLOATS)
    positions, slots = (tensor(torch.randint(0, bound, (batch, tokens), generator=g),
                               torch.int64, SPECIAL_INTS + [bound])
                        for bound in (table_len, max_len))
    cos, sin_signed = (tensor(torch.randn(table_len, shape.head_dim, generator=g),
                              torch.bfloat16, SPECIAL_FLOATS) for _ in range(2))
    cache = torch.randn(num_layers + data.draw(st.integers(0, 1)), 2, batch + 1,
                        shape.kv_heads, max_len, shape.head_dim, generator=g)
    cache = cache[:, :, :batch].to(data.draw(st.sampled_from([torch.float32] * 9
                                                              + [torch.bfloat16])))
    read_len = draw_number(data, [max_len] * 12 + [max(max_len // 2, 1)] * 6
                           + [0, max_len + 1, -1])
    mask = None
    if data.draw(st.booleans()):
        mask = torch.rand(data.draw(st.sampled_from([batch, 1])), 1,
                          data.draw(st.sampled_from([tokens, 1])),
                          read_len if isinstance(read_len, int) and 0 < read_len < 100 else 1,
                          generator=g) < 0.7
    saved_layers = data.draw(st.sampled_from([[]] * 4 + [[0], [num_layers - 1]] * 2
                                             + [[num_layers], [-1]]))
    args = [h, positions, slots, cache, cos, sin_signed, mask, read_len, saved_layers]
    inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    returned, out = call(kernel.__call__, *args)
    if not returned:  # nothing written
        for before, after in zip(inputs, args):
            if isinstance(after, torch.Tensor):
                torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
        return False
    got_h, got_saved = out
    if got_h.numel() == 0:  # no rows: nothing computed (the ops one by one want dense strides)
        return True
    # h dense: a (1, 1) tensor with a stride of 2 is contiguous to torch, not to panel_matmul
    dense_h = inputs[0].clone(memory_format=torch.contiguous_format)
    want_h, want_saved = one_by_one(layers, shape, dense_h, *inputs[1:8], saved_layers)
    assert torch.equal(got_h.view(torch.int16), want_h.view(torch.int16)), "h"
    bits = torch.int32 if cache.dtype == torch.float32 else torch.int16
    assert torch.equal(cache.view(bits), inputs[3].view(bits)), "cache"
    assert got_saved.keys() == want_saved.keys()
    for layer, saved in got_saved.items():
        assert torch.equal(saved.view(torch.int16), want_saved[layer].view(torch.int16))
    return True


CASES = {"select_tree": fuzz_select_tree, "tree_metadata": fuzz_tree_metadata,
         "unpack_tree_mask": fuzz_unpack_tree_mask, "verify_tree_greedy": fuzz_verify_tree_greedy,
         "verify_tree_sampling": fuzz_verify_tree_sampling, "compact_kv_": fuzz_compact_kv_,
         "philox_uniforms": fuzz_philox_uniforms, "rope_kv_write": fuzz_rope_kv_write,
         "add_rms_norm": fuzz_add_rms_norm, "panel_matmul": fuzz_panel_matmul,
         "decode_attention": fuzz_decode_attention, "silu_mul": fuzz_silu_mul,
         "sample_draft": fuzz_sample_draft, "decoder_layers": fuzz_decoder_layers}
