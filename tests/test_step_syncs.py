"""A decode step waits for the device at most once (plain) or twice (speculative): counted on
the CPU as the tensor-to-host reads a step makes, which on a GPU are host syncs.

Counted: scalar reads (item, int, bool, float, index: aten._local_scalar_dense), tolist /
numpy, and the ops whose output shape depends on tensor values (nonzero, masked_select,
unique, boolean indexing), which a GPU must also finish before the host can go on."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.sampled_tree import SampledTree
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.workers.harvest import HarvestBuffer
from tests.speculative_fixtures import PROMPTS

PLAIN_BOUND, SPECULATIVE_BOUND = 1, 2

_DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                   torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
                   torch.ops.aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Counts tensor-to-host reads while active (and while `counting`)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._patched = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default or func in _DATA_DEPENDENT:
            self.count += 1
        elif func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.count += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def _reads_per_step(engine: RolloutEngine, requests, strategy) -> list[tuple[bool, int]]:
    """(speculative, host reads) of every decode step of one generate call (retirement
    included), admission excluded."""
    steps, inner = [], engine._step
    reads = HostReads()

    def counted_step(run):
        plan = None if run.choose is None else run.choose(len(run.running), 0)
        before = reads.count
        inner(run)
        steps.append((plan is not None, reads.count - before))

    engine._step = counted_step
    try:
        with reads:
            engine.generate(requests, strategy)
    finally:
        del engine._step
    return steps


def _requests(temperature: float):
    # unequal prompts and lengths: rows finish at different steps and move
    return [Request(p, SamplingParams(temperature=temperature, max_tokens=8 + 3 * i, seed=i))
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_plain_step_reads_the_host_once(target, drafter, temperature):
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), drafter,
                           harvest=HarvestBuffer())
    # None: plain steps with no drafter in use; then plain steps with the drafter following
    # (its backlog filling and flushing) and the harvest on
    for strategy in (None, lambda batch: None if batch > 2 else Strategy(3, 1, 4)):
        steps = _reads_per_step(engine, _requests(temperature), strategy)
        plain = [count for speculative, count in steps if not speculative]
        assert plain and max(plain) <= PLAIN_BOUND, plain


@pytest.mark.parametrize("plan", [Strategy(4, 1, 5), Strategy(3, 2, 6), SampledChain(3),
                                  SampledTree(3, 2), SuffixMatch(4)], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_speculative_step_reads_the_host_at_most_twice(target, drafter, plan, temperature):
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), drafter,
                           harvest=HarvestBuffer())
    steps = _reads_per_step(engine, _requests(temperature), plan)
    speculative = [count for is_speculative, count in steps if is_speculative]
    assert speculative and max(speculative) <= SPECULATIVE_BOUND, speculative


def test_the_counter_sees_each_kind_of_read():
    x = torch.arange(6)
    with HostReads() as reads:
        int(x.max()), x.tolist(), bool((x > 2).any()), x[x > 2], torch.nonzero(x)
    assert reads.count == 5
