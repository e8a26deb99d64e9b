"""The engine's fixed-shape decode passes (tlt_core.engine.step_graphs): on the CPU they run
eagerly, and must give what the dynamic path gives, for every kind of step; the weights they
read are refreshed in place, so an optimizer step is seen without capturing again."""

import pytest
import torch

from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.sampled_tree import SampledTree
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.engine.step_graphs import StepGraphs, edges
from tlt_core.workers.harvest import HarvestBuffer
from tests.speculative_fixtures import PROMPTS, tiny_target

PLANS = [None, Strategy(4, 1, 5), Strategy(3, 2, 6), SampledChain(3), SampledTree(3, 2),
         SuffixMatch(4)]


def _requests(temperature):
    return [Request(p, SamplingParams(temperature=temperature, max_tokens=6 + 4 * i, seed=i,
                                      top_p=0.9 if temperature else 1.0))
            for i, p in enumerate(PROMPTS)]


def _generate(target, drafter, graphs, strategy, temperature, max_batch=5):
    engine = RolloutEngine(target, EngineConfig(max_batch=max_batch, max_len=200, graphs=graphs),
                           drafter, harvest=HarvestBuffer())
    result = engine.generate(_requests(temperature), strategy)
    return engine, result


def test_edges_cover_every_size():
    assert edges(1, 6) == (1, 2, 4, 6)
    assert edges(128, 128) == (128,)
    assert edges(128, 1088) == (128, 256, 512, 1024, 1088)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_static_passes_equal_the_dynamic_path(target, drafter, plan, temperature):
    """Same tokens (float32: the padded batch and the context edge change no greedy choice and
    no sample), log-probs equal to rounding, same acceptance."""
    _, dynamic = _generate(target, drafter, False, plan, temperature)
    engine, static = _generate(target, drafter, True, plan, temperature)
    assert isinstance(engine.graphs, StepGraphs) and not engine.graphs.pool.enabled
    for a, b in zip(dynamic.rollouts, static.rollouts):
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    assert static.acceptance_length == dynamic.acceptance_length


def test_an_adaptive_switch_between_plain_and_speculative_steps_matches(target, drafter):
    policy = lambda batch: None if batch > 3 else Strategy(4, 1, 5)  # noqa: E731
    _, dynamic = _generate(target, drafter, False, policy, 0.0, max_batch=8)
    _, static = _generate(target, drafter, True, policy, 0.0, max_batch=8)
    assert [r.tokens.tolist() for r in static.rollouts] == [
        r.tokens.tolist() for r in dynamic.rollouts]


def test_capture_runs_every_pass_on_scratch_state(target, drafter):
    """At every batch and context edge, up to the cache's last slot: with more samples than
    cache rows (they queue), and a tree that feeds more nodes than it verifies."""
    engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=300, graphs=True), drafter)
    plans = [Strategy(3, 1, 4), Strategy(2, 2, 4), Strategy(3, 4, 6), SampledChain(2),
             SuffixMatch(3)]
    assert plans[2].fed_nodes > plans[2].num_verify_tokens
    slots = engine.cache.shape.max_len
    engine.graphs.capture(plans, drafter.config.feature_layers, 9, slots)
    # the engine is left empty, and a call afterwards is unchanged
    assert not engine.cache.host_lengths.any() and not engine.cache.lengths.any()
    _, reference = _generate(target, drafter, False, Strategy(3, 1, 4), 0.0)
    again = engine.generate(_requests(0.0), Strategy(3, 1, 4))
    assert [r.tokens.tolist() for r in again.rollouts] == [
        r.tokens.tolist() for r in reference.rollouts]


def test_an_optimizer_step_is_refreshed_in_place():
    """The packed copies a graph reads keep their memory and take the new values; a parameter
    replaced by another tensor bumps the generation instead (graphs are captured again)."""
    torch.manual_seed(0)
    model = tiny_target()
    with torch.no_grad():
        for layer in model.model.layers:  # biases: copies in the packed pass
            layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(model.config.hidden_size))
    model.inference_layout = "views"
    generation = model.refresh_inference()
    packed = model._decoder.layers.packed[0]
    bias_memory = packed.o_bias.data_ptr()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.bias.add_(1.0)  # an optimizer step: in place
    assert model.refresh_inference() == generation
    packed = model._decoder.layers.packed[0]
    assert packed.o_bias.data_ptr() == bias_memory and bool((packed.o_bias == 1.0).all())
    old = model.model.layers[0].self_attn.o_proj.weight
    model.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(old.detach().clone())
    assert model.refresh_inference() != generation
    assert old.data_ptr() != model._decoder.layers.packed[0].o.data_ptr()


def test_graphs_follow_an_optimizer_step_between_calls(target, drafter):
    """A second call after the target's weights changed in place decodes with the new weights
    (graphs=True vs a fresh dynamic engine on the same weights)."""
    target = tiny_target(seed=3)
    engine = RolloutEngine(target, EngineConfig(max_batch=5, max_len=200, graphs=True))
    engine.generate(_requests(0.0))
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(1.1)
    after = engine.generate(_requests(0.0))
    fresh = RolloutEngine(target, EngineConfig(max_batch=5, max_len=200, graphs=False))
    expected = fresh.generate(_requests(0.0))
    assert [r.tokens.tolist() for r in after.rollouts] == [
        r.tokens.tolist() for r in expected.rollouts]


def test_bad_graph_settings_are_refused():
    with pytest.raises(ValueError, match="graph_pool"):
        EngineConfig(graph_pool="one")
    with pytest.raises(ValueError, match="graphs"):
        EngineConfig(graphs="yes")
