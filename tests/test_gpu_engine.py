"""The engine and speculative rollout on a CUDA device (marked gpu; skipped without one):
greedy SD equals plain decoding there, and both equal the CPU run."""

import pytest

from tlt_core.drafting.drafter import Drafter
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.drafting.tree import Strategy

from tests.speculative_fixtures import PROMPTS, tiny_target, train_drafter

pytestmark = pytest.mark.gpu


def test_speculative_rollout_on_cuda_equals_cpu():
    target = tiny_target()
    drafter = train_drafter(target, steps=60)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in PROMPTS]
    cpu = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48)).generate(requests)
    state = drafter.state_dict()
    target_gpu = target.to("cuda")
    drafter_gpu = Drafter(target_gpu)
    drafter_gpu.load_state_dict(state)
    engine = RolloutEngine(target_gpu, EngineConfig(max_batch=4, max_len=48), drafter_gpu.eval())
    plain = engine.generate(requests)
    for strategy in (Strategy(4, 1, 5), Strategy(5, 4, 16)):
        spec = engine.generate(requests, strategy=strategy)
        assert [r.tokens.tolist() for r in spec.rollouts] == [r.tokens.tolist() for r in plain.rollouts]
        assert spec.acceptance_length > 1.0
    assert [r.tokens.tolist() for r in plain.rollouts] == [r.tokens.tolist() for r in cpu.rollouts]
    target.to("cpu")


def test_harvest_and_spot_training_on_cuda():
    """Harvested positions stay on the GPU until assembled on the CPU; spot-training batches
    move back to the drafter's device; the refreshed drafter still drafts losslessly."""
    from tlt_core.workers.harvest import HarvestBuffer
    from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer

    target = tiny_target().to("cuda")
    drafter = Drafter(target).eval()
    harvest = HarvestBuffer()
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=48), drafter, harvest)
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in PROMPTS]
    plain = engine.generate(requests)
    assert harvest.collect() == len(PROMPTS) and harvest.records[0].features.device.type == "cpu"
    trainer = SpotTrainer(drafter, harvest, SpotConfig(lr=3e-3, batch_tokens=256))
    first = trainer.train_until(lambda: False, max_steps=1)
    later = trainer.train_until(lambda: False, max_steps=40)
    assert later.last_loss < first.last_loss
    spec = engine.generate(requests, strategy=Strategy(4, 1, 5))
    assert [r.tokens.tolist() for r in spec.rollouts] == [r.tokens.tolist() for r in plain.rollouts]


def test_graph_replays_equal_eager_passes_also_after_weight_updates():
    """On CUDA, decoding from captured graphs gives the eager engine's tokens (float32): for
    plain, chain, tree and sampled-chain steps; after an optimizer step on the target; and
    after the drafter is refreshed (trained further). The shared pool reserves no more than
    one pool per graph."""
    import torch

    from tlt_core.drafting.sampled_chain import SampledChain

    torch.manual_seed(0)
    target = tiny_target().to("cuda")
    drafter = train_drafter(tiny_target(), steps=40)
    drafter_gpu = Drafter(target)
    drafter_gpu.load_state_dict(drafter.state_dict())
    drafter_gpu.eval()
    requests = [Request(p, SamplingParams(temperature=t, max_tokens=16, seed=i))
                for i, p in enumerate(PROMPTS) for t in (0.0, 1.0)]
    memory = {}
    for pool in ("shared", "per_graph"):
        graphs = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64, graph_pool=pool),
                               drafter_gpu)
        eager = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64, graphs=False),
                              drafter_gpu)
        for update in ("none", "optimizer step", "drafter refresh"):
            if update == "optimizer step":
                optimizer = torch.optim.SGD(target.parameters(), lr=1e-3)
                target(torch.tensor([PROMPTS[0]], device="cuda"),
                       torch.arange(len(PROMPTS[0]), device="cuda")[None]).logits.sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            elif update == "drafter refresh":
                with torch.no_grad():
                    for p in drafter_gpu.parameters():
                        p.mul_(0.9)
            for strategy in (None, Strategy(4, 1, 5), Strategy(3, 2, 6), SampledChain(3)):
                got = graphs.generate(requests, strategy)
                want = eager.generate(requests, strategy)
                assert [r.tokens.tolist() for r in got.rollouts] == [
                    r.tokens.tolist() for r in want.rollouts], (pool, update, strategy)
        memory[pool] = graphs.graph_memory()
        assert memory[pool]["graphs"] > 0
    assert memory["shared"]["reserved_bytes"] <= memory["per_graph"]["reserved_bytes"]
