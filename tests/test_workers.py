"""Rollout workers as torch.distributed ranks (gloo, 2 processes): a 2-rank rollout equals a
1-rank one; refresh averages replicas by steps trained; the watchdog rolls back a corrupted
drafter and keeps outputs identical."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tlt_core.drafting.drafter import Drafter
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.drafting.tree import Strategy
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer
from tlt_core.workers.watchdog import DrafterWatchdog
from tlt_core.workers import WorkerGroup, refresh, rollout_round

from tests.speculative_fixtures import PROMPTS, tiny_target, train_drafter

PARAMS = SamplingParams(temperature=1.0, max_tokens=16, n=2)


def _requests():
    return [Request(p, PARAMS) for p in PROMPTS]


def _engine(harvest=None):
    torch.manual_seed(0)
    target = tiny_target()
    torch.manual_seed(1)
    drafter = Drafter(target).eval()
    return RolloutEngine(target, EngineConfig(max_batch=4, max_len=48, seed=3), drafter, harvest)


def _rank_main(rank: int, world: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    group = WorkerGroup()
    harvest = HarvestBuffer()
    engine = _engine(harvest)
    trainer = SpotTrainer(engine.drafter, harvest, SpotConfig(batch_tokens=128))
    rollouts, stats = rollout_round(group, engine, _requests(), round_id=0,
                                    strategy=Strategy(3, 1, 4), trainer=trainer)
    # refresh: replica r holds r + 1 everywhere and trained 1 + 2r steps
    with torch.no_grad():
        for p in engine.drafter.parameters():
            p.fill_(rank + 1.0)
    refreshed = refresh(group, engine.drafter, steps_trained=1 + 2 * rank)
    mean = group.mean(None if rank == 0 else 4.0)  # rank 0 had no speculative step
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens": [r.tokens.tolist() for r in rollouts],
                       "ids": [(r.request_index, r.sample_index) for r in rollouts],
                       "refreshed": refreshed, "mean": mean,
                       "weight": float(next(engine.drafter.parameters()).detach().flatten()[0]),
                       "idle_s": stats.idle_s}, f)
    dist.barrier()  # leave together
    dist.destroy_process_group()
    # Under load, a rank has aborted in C++ static teardown at interpreter exit ("terminate
    # called without an active exception") after all its work was done and written; leave
    # without running those destructors (the cause is unknown; README, "Limitations").
    os._exit(0)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_and_refresh_averages_by_steps(tmp_path):
    out = tmp_path / "rank0.json"
    mp.spawn(_rank_main, args=(2, str(tmp_path / "rendezvous"), str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    single, _ = rollout_round(WorkerGroup(), _engine(), _requests(), round_id=0,
                              strategy=Strategy(3, 1, 4))
    assert got["ids"] == [[r.request_index, r.sample_index] for r in single]
    assert got["tokens"] == [r.tokens.tolist() for r in single]
    assert got["refreshed"] and got["weight"] == pytest.approx((1 * 1 + 2 * 3) / 4)
    assert got["mean"] == 4.0


def test_one_worker_group_without_a_launcher():
    group = WorkerGroup()
    assert (group.rank, group.world_size, group.distributed) == (0, 1, False)
    ids, mine = group.shard(_requests())
    assert ids == list(range(len(PROMPTS))) and len(mine) == len(PROMPTS)
    engine = _engine()
    assert not refresh(group, engine.drafter, steps_trained=0)  # nobody trained: unchanged
    assert group.mean(3.0) == 3.0 and group.mean(None) is None


def test_shard_keeps_sibling_groups_on_one_rank():
    group = WorkerGroup()
    requests = list(range(12))  # any sequence: shard only indexes it
    group.world_size = 2
    shards = []
    for rank in range(2):
        group.rank = rank
        shards.append(group.shard(requests, group_size=3)[0])
    assert shards == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]
    group.rank = 1
    assert group.shard(requests)[0] == [1, 3, 5, 7, 9, 11]  # group_size 1: i mod N
    with pytest.raises(ValueError, match="group_size"):
        group.shard(requests, group_size=5)
    with pytest.raises(ValueError, match="group_size"):
        group.shard(requests, group_size=0)


def test_watchdog_rolls_back_a_corrupted_drafter_and_outputs_stay_identical():
    target = tiny_target()
    drafter = train_drafter(target)
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in PROMPTS]
    plain = [r.tokens.tolist() for r in engine.generate(requests).rollouts]
    watchdog = DrafterWatchdog(drafter, worse_ratio=0.8, collapse_below=1.2)
    strategy = Strategy(4, 1, 5)

    def run():
        result = engine.generate(requests, strategy=strategy if watchdog.sd_enabled else None)
        assert [r.tokens.tolist() for r in result.rollouts] == plain  # lossless throughout
        verdict = watchdog.observe(result.acceptance_length)
        if verdict.restore is not None:  # what the driver does with a rollback
            drafter.load_state_dict(verdict.restore)
        return verdict.event

    assert run() == "ok"  # version 0 becomes the healthy one
    good = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():  # a broken refresh
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 3)
    watchdog.publish()
    assert run() == "rolled_back"  # detected on the first round that used it
    assert all(torch.equal(good[k], v) for k, v in drafter.state_dict().items())
    assert watchdog.version == 0 and run() == "ok"

    fresh = DrafterWatchdog(Drafter(target).eval(), collapse_below=1.5)  # no healthy version
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), fresh.drafter)
    result = engine.generate(requests, strategy=strategy)
    assert fresh.observe(result.acceptance_length).event == "sd_disabled" and not fresh.sd_enabled
    assert [e["event"] for e in fresh.events] == ["sd_disabled"]


def test_bench_drafter_drift_and_summary():
    """The evolving target's task (countdown by two) is well formed, and the summary computes
    its acceptance ratio and training overhead from per-round rows."""
    from tlt_core.bench.drafter import drifted_solution, summarize
    from tlt_core.embedded.task import CharTokenizer, Problem

    drifted = drifted_solution(Problem("37+05", "", "", 0))
    assert drifted.solution == "37;+05=42;+03=45;+01=46;#46" and drifted.answer == "46"
    assert drifted_solution(Problem("10-04", "", "", 0)).solution == "10;-04=06;-02=04;#04"
    CharTokenizer().response_ids(drifted.solution)  # only task characters
    rows = [{"round": k, "rank": r, "spot_on_acceptance_length": 2.0 + k,
             "frozen_acceptance_length": 2.0, "spot_on_makespan_s": 1.0 + 0.01 * r,
             "spot_off_makespan_s": 1.0, "spot_on_spot_steps": 3, "spot_on_rollout_s": 1.0,
             "spot_on_harvest_s": 0.004, "spot_on_yield_lag_s": 0.001 * r}
            for k in range(4) for r in range(2)]
    summary = summarize(rows, rounds=4)
    assert summary["spot_vs_frozen_acceptance"] == pytest.approx((4.0 + 5.0) / 2 / 2.0)
    assert summary["spot_training_overhead"] == pytest.approx(0.01)
    assert summary["spot_steps_total"] == 24
    assert summary["spot_training_overhead_accounted"] == pytest.approx(4 * 0.005 / 4.04)
