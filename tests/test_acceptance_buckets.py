"""Acceptance by context position: every speculative step's per-bucket rows and emitted tokens
are those of its rows' context positions (tokens in the target's cache when the step began),
rebuilt here from the positions the engine hands its harvest; they sum to the step's totals;
short prompts fill only the first bucket; `acceptance_by_position` is emitted / rows per
bucket."""

import pytest
import torch

from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target, train_drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.engine.records import (POSITION_BUCKET_EDGES, POSITION_BUCKET_LABELS,
                                     RolloutResult, SpecStepStats, acceptance_by_position,
                                     bucket_counts)

LABELS = ("0-256", "256-1k", "1k+")


def bucket_of(context: int) -> int:
    """The bucket of a context, written out from the labels rather than with the library's
    helper."""
    return 0 if context < 256 else 1 if context < 1024 else 2


class ContextRecorder:
    """A harvest sink that rebuilds every decode step's rows and their context positions: a
    row's context is the number of positions handed for it before (its prompt at admission,
    then what each step kept), which is its committed length in the target's cache."""

    def __init__(self):
        self.handed: dict = {}  # sample key -> positions handed so far
        self.steps: list[list[tuple]] = []  # per step: (key, context, kept) per row
        self.finished: list = []

    def add_step(self, keys, tokens, features, last_hidden, counts):
        if keys[0] not in self.handed:  # a prefill: newly admitted samples' prompts
            assert not any(key in self.handed for key in keys)
            self.handed.update(zip(keys, counts))
            return
        self.steps.append([(key, self.handed[key], count) for key, count in zip(keys, counts)])
        for key, count in zip(keys, counts):
            self.handed[key] += count

    def finish(self, key):
        self.finished.append(key)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return train_drafter(target, steps=60)


def test_the_bucket_constants():
    assert POSITION_BUCKET_EDGES == (256, 1024) and POSITION_BUCKET_LABELS == LABELS
    contexts = [0, 255, 256, 1023, 1024, 5000]
    assert bucket_counts(contexts, [1, 2, 3, 4, 5, 6]) == ((2, 2, 2), (3, 7, 11))
    assert [bucket_of(c) for c in contexts] == [0, 0, 1, 1, 2, 2]


def test_buckets_are_the_rows_context_positions(target, drafter):
    """Prompts on both sides of 256 and 1024 (two of them cross an edge while decoding), more
    samples than rows (admissions mid-call, rows moving on retirement), every step
    speculative."""
    g = torch.Generator().manual_seed(5)
    lengths = [3, 250, 300, 1020, 7, 1100]
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=16)) for p in prompts]
    recorder = ContextRecorder()
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=1120), drafter, recorder)
    result = engine.generate(requests, strategy=Strategy(4, 2, 8))

    assert len(result.spec_steps) == result.decode_steps == len(recorder.steps)
    # The recorder agrees with the rollouts: every sample's positions are its prompt and its
    # tokens but the last (never fed); keys are (request_index, sample_index).
    assert recorder.handed == {(r.request_index, r.sample_index):
                               len(r.prompt_ids) + len(r.tokens) - 1 for r in result.rollouts}
    assert sorted(recorder.finished) == sorted(recorder.handed)
    seen = set()
    for number, (stats, rows) in enumerate(zip(result.spec_steps, recorder.steps)):
        assert stats.batch == len(rows)
        assert sum(stats.bucket_rows) == stats.batch
        assert sum(stats.bucket_emitted) == stats.emitted
        expected_rows = [0, 0, 0]
        kept, finishing = [0, 0, 0], [False] * 3
        later = {key for key, _, _ in recorder.steps[number + 1]} \
            if number + 1 < len(recorder.steps) else set()
        for key, context, count in rows:
            bucket = bucket_of(context)
            seen.add((bucket, key))
            expected_rows[bucket] += 1
            kept[bucket] += count
            finishing[bucket] |= key not in later
        assert list(stats.bucket_rows) == expected_rows, number
        for bucket in range(3):
            # a row that goes on kept all it emitted; one that finished may have emitted past
            # its stop (max_tokens), which the sequence and the harvest drop
            if finishing[bucket]:
                assert stats.bucket_emitted[bucket] >= kept[bucket], number
            else:
                assert stats.bucket_emitted[bucket] == kept[bucket], number
    assert {bucket for bucket, _ in seen} == {0, 1, 2}
    crossed = {key for _, key in seen if (0, key) in seen and (1, key) in seen}
    crossed |= {key for _, key in seen if (1, key) in seen and (2, key) in seen}
    assert len(crossed) == 2  # the prompts of 250 and 1020 tokens
    by_position = result.acceptance_by_position
    assert list(by_position) == list(LABELS)
    for bucket, label in enumerate(LABELS):
        rows = sum(s.bucket_rows[bucket] for s in result.spec_steps)
        emitted = sum(s.bucket_emitted[bucket] for s in result.spec_steps)
        assert by_position[label] == pytest.approx(emitted / rows) and by_position[label] >= 1


def test_short_prompts_fill_only_the_first_bucket(target, drafter):
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=24)) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter)
    result = engine.generate(requests, strategy=Strategy(4, 1, 4))
    assert result.spec_steps
    for stats in result.spec_steps:
        assert stats.bucket_rows == (stats.batch, 0, 0)
        assert stats.bucket_emitted == (stats.emitted, 0, 0)
    assert result.acceptance_by_position == {"0-256": pytest.approx(result.acceptance_length),
                                             "256-1k": None, "1k+": None}
    plain = engine.generate(requests)
    assert plain.acceptance_by_position == dict.fromkeys(LABELS)


def stats(step, rows, emitted):
    return SpecStepStats(step, sum(rows), "(4,1,4)", 4 * sum(rows), sum(emitted) - sum(rows),
                         sum(emitted), 0.0, 0.0, 0.0, bucket_rows=rows, bucket_emitted=emitted)


def test_acceptance_by_position_is_emitted_per_row_step():
    steps = (stats(0, (2, 1, 0), (5, 3, 0)), stats(1, (1, 0, 1), (1, 0, 4)),
             stats(2, (0, 0, 2), (0, 0, 2)))
    expected = {"0-256": 6 / 3, "256-1k": 3 / 1, "1k+": 6 / 3}
    assert acceptance_by_position(steps) == pytest.approx(expected)
    result = RolloutResult([], 0.0, 3, steps)
    assert result.acceptance_by_position == pytest.approx(expected)
    assert result.acceptance_length == pytest.approx(15 / 7)  # the buckets pooled
    assert acceptance_by_position(steps[1:]) == {"0-256": 1.0, "256-1k": None, "1k+": 2.0}
    assert acceptance_by_position(()) == dict.fromkeys(LABELS)


def test_bucket_counts_that_miss_the_totals_are_refused():
    with pytest.raises(ValueError, match="bucket_rows"):
        stats(0, (2, 1), (5, 3))
    with pytest.raises(ValueError, match="bucket_emitted"):
        SpecStepStats(0, 3, "(4,1,4)", 12, 5, 8, 0.0, 0.0, 0.0, bucket_rows=(2, 1, 0),
                      bucket_emitted=(5, 2, 0))
