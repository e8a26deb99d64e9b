"""vLLM's and SGLang's verification layouts over tlt's kernels (tlt_core.integrations.vllm_ops,
sglang_ops): each op equals a plain-Python rendition of the algorithm its module documents,
given the same uniforms; sampled outputs follow the target distribution; the ops trace under
torch.compile(fullgraph=True) and pass torch.library.opcheck; bad input raises naming the
argument. vLLM and SGLang themselves need CUDA builds of torch and are not installed here, so
the renditions below stand for their kernels (vllm/v1/sample/rejection_sampler.py,
sgl-kernel/csrc/speculative/{eagle_utils.cu,speculative_sampling.cuh})."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from tests.test_examples import load_example
from tlt_core.integrations import sglang_ops, vllm_ops
from tlt_core.ops import reference

# ---------------------------------------------------------------------------------------
# vLLM: flattened linear drafts


def vllm_case(seed: int, counts: list[int], vocab: int, *, with_draft_probs: bool,
              greedy_rows: tuple[int, ...] = (), max_spec_len: int | None = None):
    """A vLLM batch: drafts that often match the target (so paths of several tokens occur),
    target_probs with zeros (top-k applied upstream), float64 uniforms as vLLM draws them."""
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    logits = torch.randn(total, vocab, generator=g) * 2
    logits[torch.rand(total, vocab, generator=g) < 0.2] = float("-inf")
    logits[:, 0] = logits[:, 0].clamp(min=0.0)  # every row keeps some mass
    target_probs = torch.softmax(logits, -1)  # (T, V)
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.softmax(torch.randn(total, vocab, generator=g) + logits.clamp(min=-3)
                                    .nan_to_num(), -1)  # (T, V), close to p, positive
        draft = torch.multinomial(draft_probs, 1, generator=g).squeeze(1)
    else:
        draft = torch.randint(0, vocab, (total,), generator=g)
        likely = torch.rand(total, generator=g) < 0.6
        draft = torch.where(likely, target_probs.argmax(-1), draft)
    batch = len(counts)
    spec = max(counts + [1]) if max_spec_len is None else max_spec_len
    is_greedy = torch.zeros(batch, dtype=torch.bool)
    is_greedy[list(greedy_rows)] = True
    return dict(
        draft_token_ids=draft.to(torch.int32),
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32),
        draft_probs=draft_probs,
        target_probs=target_probs,
        bonus_token_ids=torch.randint(0, vocab, (batch, 1), generator=g, dtype=torch.int32),
        output_token_ids=torch.full((batch, spec + 1), -1, dtype=torch.int32),
        is_greedy=is_greedy,
        uniform_probs=torch.rand(total, generator=g, dtype=torch.float64),
        recovery_uniforms=torch.rand(batch, generator=g, dtype=torch.float64),
    )


def run_vllm(case: dict, **overrides) -> torch.Tensor:
    args = {**case, **overrides}
    args["output_token_ids"] = args["output_token_ids"].clone()
    positional = [args.pop(k) for k in ("draft_token_ids", "cu_num_draft_tokens", "draft_probs",
                                        "target_probs", "bonus_token_ids", "output_token_ids")]
    return vllm_ops.rejection_sample(*positional, **args)


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The smallest token whose running weight exceeds u * total (verify.h's final draw)."""
    running = torch.cumsum(weights, 0)
    return int(torch.nonzero(running > u * float(running[-1]))[0])


def vllm_rendition(case: dict) -> torch.Tensor:
    """vllm_ops' documented algorithm, request by request, in float64."""
    ends = case["cu_num_draft_tokens"].tolist()
    out = torch.full_like(case["output_token_ids"], -1)
    p_all = case["target_probs"].double()
    for b, end in enumerate(ends):
        start = ends[b - 1] if b else 0
        greedy = bool(case["is_greedy"][b])
        accepted_all = True
        for pos, t in enumerate(range(start, end)):
            x = int(case["draft_token_ids"][t])
            p = p_all[t] / p_all[t].sum()
            if greedy:
                out[b, pos] = int(torch.argmax(p))
                if x != int(torch.argmax(p)):
                    accepted_all = False
                    break
                continue
            if case["draft_probs"] is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = case["draft_probs"][t].double()
            if float(case["uniform_probs"][t]) < float(p[x] / q[x]):
                out[b, pos] = x
                continue
            out[b, pos] = inverse_cdf((p - q).clamp(min=0), float(case["recovery_uniforms"][b]))
            accepted_all = False
            break
        if accepted_all:
            out[b, end - start] = int(case["bonus_token_ids"][b])
    return out


def test_vllm_greedy_table():
    """vLLM's greedy contract as a table: accepted drafts, then the target's token at the first
    mismatch, or the bonus token when every draft matched; -1 after."""
    vocab = 8
    argmax = [3, 1, 4, 1, 5, 2]  # target's token at each flattened position
    target_probs = torch.full((6, vocab), 0.01)
    target_probs[torch.arange(6), torch.tensor(argmax)] = 1.0 - 0.01 * (vocab - 1)
    draft = torch.tensor([3, 1, 4, 1, 7, 2], dtype=torch.int32)  # request 1 misses at its 2nd
    cu = torch.tensor([3, 5, 5, 6], dtype=torch.int32)  # counts 3, 2, 0, 1
    bonus = torch.tensor([[6], [6], [7], [0]], dtype=torch.int32)
    out = torch.full((4, 4), -1, dtype=torch.int32)
    vllm_ops.rejection_sample(draft, cu, None, target_probs, bonus, out)
    expected = torch.tensor([[3, 1, 4, 6],    # all three accepted, then the bonus
                             [1, 5, -1, -1],  # 7 != 5: the target's 5 replaces it
                             [7, -1, -1, -1],  # no drafts: the bonus alone
                             [2, 0, -1, -1]], dtype=torch.int32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("greedy_rows", [(), (1, 4)])
def test_vllm_rejection_sample_equals_rendition(with_draft_probs, greedy_rows):
    counts = [3, 0, 5, 1, 4, 2, 5, 5]
    for seed in range(4):
        case = vllm_case(seed, counts, 12, with_draft_probs=with_draft_probs,
                         greedy_rows=greedy_rows, max_spec_len=6)
        expected = vllm_rendition(case)
        for validate in (True, False):
            got = run_vllm(case, validate=validate)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert int((expected[:, 1:] != -1).sum()) > 0  # some requests accepted drafts


def test_vllm_all_greedy_needs_no_uniforms_and_equals_rendition():
    case = vllm_case(7, [4, 2, 0, 4], 10, with_draft_probs=False, greedy_rows=(0, 1, 2, 3))
    expected = vllm_rendition(case)
    got = run_vllm(case, is_greedy=None, uniform_probs=None, recovery_uniforms=None)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def first_token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.long(), minlength=vocab).double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert float(counts[~keep].sum()) == 0  # nothing outside the support
    expected = probs[keep].double() * counts.sum()
    return float(stats.chisquare(counts[keep], expected / expected.sum() * counts.sum()).pvalue)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_vllm_sampled_first_token_follows_target(with_draft_probs):
    """Lossless: the first emitted token is distributed as p_target at that position, whatever
    the drafts; the same counts are far from the draft distribution (the test has power)."""
    rows, vocab = 6000, 6
    g = torch.Generator().manual_seed(11)
    p = torch.tensor([0.05, 0.3, 0.1, 0.0, 0.4, 0.15])
    q = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.1, 0.1])
    target_probs = p.repeat(rows * 2, 1)  # (T, V): two drafts per request
    draft_probs = q.repeat(rows * 2, 1) if with_draft_probs else None
    if with_draft_probs:
        draft = torch.multinomial(draft_probs, 1, replacement=True, generator=g).squeeze(1)
    else:
        draft = torch.full((rows * 2,), 1, dtype=torch.int64)  # an n-gram proposing token 1
    out = torch.full((rows, 3), -1, dtype=torch.int32)
    vllm_ops.rejection_sample(
        draft.to(torch.int32), torch.arange(1, rows + 1, dtype=torch.int32) * 2, draft_probs,
        target_probs, torch.zeros((rows, 1), dtype=torch.int32), out,
        is_greedy=torch.zeros(rows, dtype=torch.bool),
        uniform_probs=torch.rand(rows * 2, generator=g, dtype=torch.float64),
        recovery_uniforms=torch.rand(rows, generator=g))
    counts = first_token_counts(out[:, 0], vocab)
    assert chi_square_p(counts, p) > 1e-3
    wrong = q if with_draft_probs else torch.tensor([0.0, 1.0, 0, 0, 0, 0])
    smoothed = wrong.double() + 1e-3  # the support of q, which p's counts must not fit
    assert stats.chisquare(counts, smoothed / smoothed.sum() * counts.sum()).pvalue < 1e-6


# ---------------------------------------------------------------------------------------
# SGLang: draft trees as first-child / next-sibling links


def sglang_case(seed: int, batch: int, num_nodes: int, vocab: int, steps: int):
    """EAGLE-like trees in sgl-kernel's layout (build_tree_kernel_efficient's link order:
    children after their parent, siblings by increasing index, distinct sibling tokens), with
    targets that favour one child so that paths of several tokens occur."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    candidates = torch.zeros((batch, num_nodes), dtype=torch.int64)
    next_token = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for b in range(batch):
        depth = [0]
        candidates[b, 0] = int(torch.randint(0, vocab, (1,), generator=g))
        for c in range(1, num_nodes):
            open_nodes = [v for v in range(c) if depth[v] < steps - 1]
            parent = open_nodes[int(torch.randint(0, len(open_nodes), (1,), generator=g))]
            siblings = [int(candidates[b, s]) for s in range(1, c) if parents[b, s] == parent]
            free = [t for t in range(vocab) if t not in siblings]
            candidates[b, c] = free[int(torch.randint(0, len(free), (1,), generator=g))]
            parents[b, c] = parent
            depth.append(depth[parent] + 1)
            if next_token[b, parent] == -1:
                next_token[b, parent] = c
            else:
                last = int(next_token[b, parent])
                while next_sibling[b, last] != -1:
                    last = int(next_sibling[b, last])
                next_sibling[b, last] = c
    logits = torch.randn(batch, num_nodes, vocab, generator=g) * 1.5
    logits[torch.rand(batch, num_nodes, vocab, generator=g) < 0.15] = float("-inf")
    logits[..., 0] = logits[..., 0].clamp(min=0.0)
    target_predict = torch.randint(0, vocab, (batch, num_nodes), generator=g)
    for b in range(batch):
        for c in range(1, num_nodes):
            if float(torch.rand(1, generator=g)) < 0.5:
                logits[b, parents[b, c], candidates[b, c]] = 4.0
                target_predict[b, parents[b, c]] = candidates[b, c]
    return dict(
        predicts=torch.full((batch * num_nodes,), -7, dtype=torch.int32),
        accept_index=torch.full((batch, steps), -1, dtype=torch.int32),
        accept_token_num=torch.zeros(batch, dtype=torch.int32),
        candidates=candidates,
        retrive_index=torch.arange(batch * num_nodes).reshape(batch, num_nodes),
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        uniform_samples=torch.rand(batch, num_nodes, generator=g),
        uniform_samples_for_final_sampling=torch.rand(batch, generator=g),
        target_probs=torch.softmax(logits, -1),
        target_predict=target_predict,
        parents=parents,
    )


def children_of(case: dict, b: int, v: int) -> list[int]:
    child, out = int(case["retrive_next_token"][b, v]), []
    while child != -1:
        out.append(child)
        child = int(case["retrive_next_sibling"][b, child])
    return out


def sglang_outputs(case: dict, paths: list[list[int]], nexts: list[list[int]]):
    """(predicts, accept_index, accept_token_num) as sgl-kernel writes them for these paths."""
    predicts = case["predicts"].clone()
    accept_index = case["accept_index"].clone()
    accept_token_num = torch.zeros_like(case["accept_token_num"])
    for b, (path, tokens) in enumerate(zip(paths, nexts)):
        for j, (node, token) in enumerate(zip(path, tokens)):
            flat = int(case["retrive_index"][b, node])
            predicts[flat] = token
            accept_index[b, j] = flat
        accept_token_num[b] = len(path) - 1
    return predicts, accept_index, accept_token_num


def sglang_greedy_rendition(case: dict):
    paths, nexts = [], []
    target = case["target_predict"].reshape(-1)
    for b in range(case["candidates"].shape[0]):
        path, v = [0], 0
        while True:
            want = int(target[int(case["retrive_index"][b, v])])
            match = [c for c in children_of(case, b, v) if int(case["candidates"][b, c]) == want]
            if not match:
                break
            v = match[0]
            path.append(v)
        paths.append(path)
        nexts.append([int(target[int(case["retrive_index"][b, v])]) for v in path])
    return sglang_outputs(case, paths, nexts)


def sglang_sampling_rendition(case: dict, threshold_single: float, threshold_acc: float):
    """sglang_ops' documented coin rule, in float64."""
    paths, nexts = [], []
    for b in range(case["candidates"].shape[0]):
        path, tokens, v = [0], [], 0
        while True:
            p = case["target_probs"][b, v].double()
            coin, mass, removed, accepted = float(case["uniform_samples"][b, v]), 0.0, [], None
            for c in children_of(case, b, v):
                x = int(case["candidates"][b, c])
                mass += float(p[x])
                if p[x] > 0 and (coin <= mass / max(threshold_acc, 1e-9) or p[x] >= threshold_single):
                    accepted = c
                    break
                removed.append(x)
            if accepted is None:
                residual = p.clone()
                residual[removed] = 0.0
                tokens.append(inverse_cdf(residual,
                                          float(case["uniform_samples_for_final_sampling"][b])))
                break
            tokens.append(int(case["candidates"][b, accepted]))
            path.append(accepted)
            v = accepted
        paths.append(path)
        nexts.append(tokens)
    return sglang_outputs(case, paths, nexts)


GREEDY_ARGS = ("predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
               "retrive_next_token", "retrive_next_sibling", "target_predict")
SAMPLING_ARGS = ("predicts", "accept_index", "accept_token_num", "candidates", "retrive_index",
                 "retrive_next_token", "retrive_next_sibling", "uniform_samples",
                 "uniform_samples_for_final_sampling", "target_probs")
OUTPUTS = ("predicts", "accept_index", "accept_token_num")


def run_sglang(function, names, case: dict, *extra, **kwargs):
    args = {name: case[name].clone() if name in OUTPUTS else case[name] for name in names}
    function(*args.values(), *extra, **kwargs)
    return tuple(args[name] for name in OUTPUTS)


@pytest.mark.parametrize("num_nodes,steps", [(1, 1), (6, 6), (12, 4), (16, 8)])
def test_sglang_verify_tree_greedy_equals_rendition(num_nodes, steps):
    for seed in range(3):
        case = sglang_case(seed, 6, num_nodes, 9, steps)
        expected = sglang_greedy_rendition(case)
        for validate in (True, False):
            got = run_sglang(sglang_ops.verify_tree_greedy, GREEDY_ARGS, case, validate=validate)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.6, 0.5), (0.0, 0.0)])
@pytest.mark.parametrize("num_nodes,steps", [(6, 6), (12, 4), (16, 8)])
def test_sglang_tree_sampling_equals_rendition(thresholds, num_nodes, steps):
    threshold_single, threshold_acc = thresholds
    accepted = 0
    for seed in range(3):
        case = sglang_case(100 + seed, 6, num_nodes, 9, steps)
        expected = sglang_sampling_rendition(case, threshold_single, threshold_acc)
        for validate in (True, False):
            got = run_sglang(sglang_ops.tree_speculative_sampling_target_only, SAMPLING_ARGS,
                             case, torch.zeros_like(case["target_probs"]), threshold_single,
                             threshold_acc, validate=validate)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=0)
        accepted += int(expected[2].sum())
    assert accepted > 0


def test_sglang_sampled_first_token_follows_target():
    """Lossless at the default thresholds: the token after the root is distributed as
    p_target there; the counts are far from what always accepting the first child gives."""
    rows, vocab = 5000, 6
    one = sglang_case(3, 1, 5, vocab, 3)
    case = {name: (value.repeat(rows, *([1] * (value.dim() - 1))) if name not in OUTPUTS
                   else value) for name, value in one.items()}
    case["predicts"] = torch.full((rows * 5,), -7, dtype=torch.int32)
    case["accept_index"] = torch.full((rows, 3), -1, dtype=torch.int32)
    case["accept_token_num"] = torch.zeros(rows, dtype=torch.int32)
    case["retrive_index"] = torch.arange(rows * 5).reshape(rows, 5)
    g = torch.Generator().manual_seed(5)
    case["uniform_samples"] = torch.rand(rows, 5, generator=g)
    case["uniform_samples_for_final_sampling"] = torch.rand(rows, generator=g)
    predicts, _, _ = run_sglang(sglang_ops.tree_speculative_sampling_target_only, SAMPLING_ARGS,
                                case)
    first = predicts.reshape(rows, 5)[:, 0]  # the token after the root, per row
    p_root = one["target_probs"][0, 0]
    counts = first_token_counts(first, vocab)
    assert chi_square_p(counts, p_root) > 1e-3
    first_child = int(one["candidates"][0, int(one["retrive_next_token"][0, 0])])
    assert counts[first_child] < rows  # the walk does not just take the first child


# ---------------------------------------------------------------------------------------
# torch.compile, opcheck


def test_ops_trace_under_torch_compile_fullgraph():
    vcase = vllm_case(1, [2, 0, 3], 10, with_draft_probs=True, greedy_rows=(1,))
    scase = sglang_case(2, 3, 8, 9, 4)

    def step(vcase, scase):
        # What an engine's compiled sampler step does: allocate outputs, call the ops.
        out = torch.full_like(vcase["output_token_ids"], -1)
        vllm_ops.rejection_sample(
            vcase["draft_token_ids"], vcase["cu_num_draft_tokens"], vcase["draft_probs"],
            vcase["target_probs"], vcase["bonus_token_ids"], out, is_greedy=vcase["is_greedy"],
            uniform_probs=vcase["uniform_probs"], recovery_uniforms=vcase["recovery_uniforms"],
            validate=False)
        predicts = torch.full_like(scase["predicts"], -7)
        accept_index = torch.full_like(scase["accept_index"], -1)
        accept_token_num = torch.zeros_like(scase["accept_token_num"])
        sglang_ops.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_token_num, scase["candidates"],
            scase["retrive_index"], scase["retrive_next_token"], scase["retrive_next_sibling"],
            scase["uniform_samples"], scase["uniform_samples_for_final_sampling"],
            scase["target_probs"] * 1.0, validate=False)
        greedy_predicts = torch.full_like(scase["predicts"], -7)
        greedy_index = torch.full_like(scase["accept_index"], -1)
        greedy_num = torch.zeros_like(scase["accept_token_num"])
        sglang_ops.verify_tree_greedy(
            greedy_predicts, greedy_index, greedy_num, scase["candidates"],
            scase["retrive_index"], scase["retrive_next_token"], scase["retrive_next_sibling"],
            scase["target_predict"], validate=False)
        return out, predicts, accept_index, accept_token_num, greedy_predicts, greedy_num

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(vcase, scase), step(vcase, scase)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(step(vcase, scase)[0], vllm_rendition(vcase), rtol=0, atol=0)


def test_ops_pass_opcheck():
    """Schema, fake implementation and functionalization agree with the real kernels."""
    vcase = vllm_case(4, [2, 1, 3], 10, with_draft_probs=True, greedy_rows=(0,))
    torch.library.opcheck(torch.ops.tlt.vllm_rejection_sample.default, (
        vcase["output_token_ids"].clone(), vcase["draft_token_ids"],
        vcase["cu_num_draft_tokens"], vcase["draft_probs"], vcase["target_probs"],
        vcase["bonus_token_ids"], vcase["is_greedy"], vcase["uniform_probs"],
        vcase["recovery_uniforms"], True))
    scase = sglang_case(6, 2, 6, 9, 4)
    outputs = [scase[name].clone() for name in OUTPUTS]
    torch.library.opcheck(torch.ops.tlt.sglang_verify_tree_greedy.default, (
        *outputs, *(scase[name] for name in GREEDY_ARGS[3:]), True))
    outputs = [scase[name].clone() for name in OUTPUTS]
    torch.library.opcheck(torch.ops.tlt.sglang_tree_speculative_sampling_target_only.default, (
        *outputs, *(scase[name] for name in SAMPLING_ARGS[3:]), None, 1.0, 1.0, True))


def test_greedy_ops_equal_the_reference_oracle():
    """Both greedy layouts give what tlt_core.ops.reference.verify_tree_greedy gives on the same
    tree in tlt's layout (vLLM: each request a chain, the bonus token after a full accept)."""
    vcase = vllm_case(21, [3, 0, 4, 2, 4], 11, with_draft_probs=False,
                      greedy_rows=(0, 1, 2, 3, 4))
    got = run_vllm(vcase, is_greedy=None, uniform_probs=None, recovery_uniforms=None)
    ends = vcase["cu_num_draft_tokens"].tolist()
    for b, end in enumerate(ends):
        start = ends[b - 1] if b else 0
        n = end - start
        logits = torch.cat((vcase["target_probs"][start:end], torch.zeros(1, 11)))[None]
        tokens = torch.cat((torch.zeros(1, dtype=torch.int64),
                            vcase["draft_token_ids"][start:end].long()))[None]
        parents = (torch.arange(n + 1, dtype=torch.int32) - 1)[None]
        oracle = reference.verify_tree_greedy(logits, tokens, parents)
        k = int(oracle.num_accepted[0])
        want = oracle.emitted_tokens[0, :k + 1].clone()
        if k == n:
            want[k] = int(vcase["bonus_token_ids"][b])
        assert got[b, :k + 1].tolist() == want.tolist() and set(got[b, k + 1:].tolist()) <= {-1}

    scase = sglang_case(22, 5, 10, 9, 5)
    scase["target_predict"] = scase["target_probs"].argmax(-1)
    predicts, accept_index, accept_token_num = run_sglang(sglang_ops.verify_tree_greedy,
                                                          GREEDY_ARGS, scase)
    oracle = reference.verify_tree_greedy(scase["target_probs"], scase["candidates"],
                                          scase["parents"].to(torch.int32))
    torch.testing.assert_close(accept_token_num, oracle.num_accepted, rtol=0, atol=0)
    for b in range(5):
        path = oracle.accept_index[b, :int(oracle.num_accepted[b]) + 1].long()
        flat = scase["retrive_index"][b, path]
        assert accept_index[b, :len(path)].tolist() == flat.tolist()
        assert predicts[flat].tolist() == oracle.emitted_tokens[b, :len(path)].tolist()


def on_cuda(case: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@pytest.mark.gpu
def test_ops_on_cuda_equal_cpu_and_replay_in_a_cuda_graph():
    """With validate=False the ops make no host sync: on CUDA they give the CPU's outputs, they
    capture in a CUDA graph, and a replay reads the inputs' new uniforms."""
    vcase = vllm_case(3, [3, 0, 5, 2], 1000, with_draft_probs=True, greedy_rows=(1,),
                      max_spec_len=5)
    scase = sglang_case(4, 4, 12, 50, 5)
    vgpu, sgpu = on_cuda(vcase), on_cuda(scase)

    def step(vcase, scase):
        vllm_out = run_vllm(vcase, validate=False)
        greedy = run_sglang(sglang_ops.verify_tree_greedy, GREEDY_ARGS, scase, validate=False)
        sampled = run_sglang(sglang_ops.tree_speculative_sampling_target_only, SAMPLING_ARGS,
                             scase, None, 0.9, 0.8, validate=False)
        return (vllm_out, *greedy, *sampled)

    for got, want in zip(step(vgpu, sgpu), step(vcase, scase)):
        assert torch.equal(got.cpu(), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(vgpu, sgpu)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(vgpu, sgpu)
    g = torch.Generator().manual_seed(99)
    for case, names in ((vgpu, ("uniform_probs", "recovery_uniforms")),
                        (sgpu, ("uniform_samples", "uniform_samples_for_final_sampling"))):
        for name in names:
            case[name].copy_(torch.rand(case[name].shape, generator=g, dtype=case[name].dtype))
    graph.replay()
    for got, want in zip(captured, step(vgpu, sgpu)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------
# examples


@pytest.mark.parametrize("name", ["vllm_rejection_sample", "sglang_tree_verify"])
def test_example_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example(name).main(["--help"])
    assert exit_info.value.code == 0
    assert "prove" in load_example(name).__doc__
    assert "usage:" in capsys.readouterr().out


def test_vllm_example_compiles_and_is_lossless():
    result = load_example("vllm_rejection_sample").main([])  # asserts its claims itself
    assert result["compiled_equal"] and result["p_value"] > 1e-3
    assert result["control_p_value"] < 1e-3
    assert 1.0 < result["mean_tokens_per_request"] < 4.0


def test_sglang_example_layouts_agree_and_sampling_is_lossless():
    result = load_example("sglang_tree_verify").main([])  # asserts its claims itself
    assert result["p_value"] > 1e-3 and result["control_p_value"] < 1e-3
    assert result["mean_accepted_relaxed"] > result["mean_accepted"] > 0


# ---------------------------------------------------------------------------------------
# bad input


def test_vllm_bad_input_names_the_argument():
    case = vllm_case(9, [2, 3], 10, with_draft_probs=True, greedy_rows=(0,))
    bad = {
        "cu_num_draft_tokens": (ValueError, dict(
            cu_num_draft_tokens=torch.tensor([2, 4], dtype=torch.int32))),  # counts 4 of 5
        "target_probs": (TypeError, dict(target_probs=case["target_probs"].double())),
        "draft_probs": (ValueError, dict(draft_probs=torch.softmax(torch.randn(5, 11), -1))),
        "output_token_ids": (TypeError, dict(output_token_ids=torch.full((2, 4), -1))),
        "uniform_probs": (ValueError, dict(uniform_probs=None)),
        "recovery_uniforms": (ValueError, dict(recovery_uniforms=torch.full((2,), 1.0))),
        "draft_token_ids": (ValueError, dict(
            draft_token_ids=torch.tensor([1, 2, 3, 4, 10], dtype=torch.int32))),
        "bonus_token_ids": (ValueError, dict(bonus_token_ids=torch.zeros((3, 1),
                                                                          dtype=torch.int32))),
        "is_greedy": (TypeError, dict(is_greedy=torch.zeros(2, dtype=torch.int32))),
    }
    for name, (error, override) in bad.items():
        with pytest.raises(error, match=name):
            run_vllm(case, **override)
    too_long = torch.full((2, 3), -1, dtype=torch.int32)  # max_spec_len 2 < 3 drafts
    with pytest.raises(ValueError, match="cu_num_draft_tokens.*max_spec_len"):
        run_vllm(case, output_token_ids=too_long)
    zero_q = case["draft_probs"].clone()
    x = int(case["draft_token_ids"][0])
    zero_q[0] = 1.0 / 9
    zero_q[0, x] = 0.0
    with pytest.raises(ValueError, match="draft_probs.*probability 0"):
        run_vllm(case, draft_probs=zero_q)


def test_vllm_bad_layout_is_reported_while_tracing():
    case = vllm_case(9, [2, 3], 10, with_draft_probs=False)

    def step(target_probs):
        out = torch.full((2, 4), -1, dtype=torch.int32)
        return vllm_ops.rejection_sample(case["draft_token_ids"], case["cu_num_draft_tokens"],
                                          None, target_probs, case["bonus_token_ids"], out,
                                          validate=False)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="target_probs: expected shape"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(case["target_probs"][None])


def test_sglang_bad_input_names_the_argument():
    case = sglang_case(12, 3, 8, 9, 4)
    sampling = sglang_ops.tree_speculative_sampling_target_only
    greedy = sglang_ops.verify_tree_greedy
    decreasing = case["retrive_next_sibling"].clone()
    row, node = (int(i) for i in torch.nonzero(decreasing != -1)[0])
    decreasing[row, node] = 0
    deep = case["accept_index"][:, :1].clone()  # room for no accepted token
    out_of_vocab = case["candidates"].clone()
    out_of_vocab[0, 1] = 9
    bad = [
        ("predicts", TypeError, sampling, SAMPLING_ARGS, dict(predicts=case["predicts"].long())),
        ("retrive_index", ValueError, greedy, GREEDY_ARGS,
         dict(retrive_index=case["retrive_index"][:, :5])),
        ("retrive_next_sibling", ValueError, greedy, GREEDY_ARGS,
         dict(retrive_next_sibling=decreasing)),
        ("accept_index", ValueError, sampling, SAMPLING_ARGS, dict(accept_index=deep)),
        ("candidates", ValueError, sampling, SAMPLING_ARGS, dict(candidates=out_of_vocab)),
        ("target_probs", TypeError, sampling, SAMPLING_ARGS,
         dict(target_probs=case["target_probs"].double())),
        ("uniform_samples", ValueError, sampling, SAMPLING_ARGS,
         dict(uniform_samples=case["uniform_samples"] + 1)),
        ("target_predict", ValueError, greedy, GREEDY_ARGS,
         dict(target_predict=case["target_predict"][:2])),
    ]
    for name, error, function, names, override in bad:
        with pytest.raises(error, match=name):
            run_sglang(function, names, {**case, **override})
    with pytest.raises(ValueError, match="draft_probs"):
        run_sglang(sampling, SAMPLING_ARGS, case, torch.ones_like(case["target_probs"]))
    with pytest.raises(ValueError, match="draft_probs: vocabulary"):
        run_sglang(sampling, SAMPLING_ARGS, case, torch.zeros(3, 8, 10))
    with pytest.raises(ValueError, match="threshold_acc"):
        run_sglang(sampling, SAMPLING_ARGS, case, None, 1.0, 1.5)
