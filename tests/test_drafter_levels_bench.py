"""bench/drafter_levels.py's per-level acceptance is the training loss's: at level 1 the
teacher-forced `accept` metric, at level 2 the unrolled step's, over the same positions (two
implementations of sum_x min(p, q) that agree)."""

import pytest
import torch

from tlt_core.drafting.training import collect_records, make_batch, unrolled_loss

from tests.test_unrolled_training import DRAFTERS, fresh_drafter, sequences
from tests.bench_scripts import load_bench
from tests.speculative_fixtures import tiny_target_with_a_final_norm


@pytest.mark.parametrize("kind", ("eagle", "tlt fused"))
def test_level_acceptance_is_the_loss_s_sampled_acceptance(kind):
    bench = load_bench("drafter_levels")
    target = tiny_target_with_a_final_norm()
    drafter = fresh_drafter(target, **DRAFTERS[kind])
    records = collect_records(target, sequences((13,)), drafter.config.feature_layers)
    prompt_length = 4
    batch = make_batch(records)
    batch.mask[0, :prompt_length - 1] = False  # the warm-up scores response roots only
    with torch.no_grad():
        _, metrics = unrolled_loss(drafter, batch, 2)
        levels = bench.level_acceptance(target, drafter, records[0], prompt_length, 2)
    assert [len(v) for v in levels] == [13 - prompt_length, 13 - prompt_length - 1]
    assert sum(levels[0]) / len(levels[0]) == pytest.approx(metrics["accept"], abs=1e-5)
    assert sum(levels[1]) / len(levels[1]) == pytest.approx(metrics["accept_step2"], abs=1e-5)
