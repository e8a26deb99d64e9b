"""The learned-drafter protocol (tlt_core.drafting.learned): both drafter forms are learned
drafters the engine runs alike, eager or at fixed shapes, and an object lacking a member is
refused where it enters, by name."""

import types

import pytest
import torch

from tlt_core.drafting.drafter import Drafter
from tlt_core.drafting.eagle3 import Eagle3Config, Eagle3Drafter
from tlt_core.drafting.learned import LearnedDrafter, check_drafter
from tlt_core.drafting.tree import Strategy
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.transformer import ModelConfig
from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _eagle3(target) -> Eagle3Drafter:
    torch.manual_seed(2)
    layer = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=8)
    return Eagle3Drafter(target, Eagle3Config(layer, (0, 1), draft_vocab=24),
                         torch.arange(VOCAB - 24, VOCAB)).eval()


def test_both_drafter_forms_are_learned_drafters(target):
    for drafter in (Drafter(target).eval(), _eagle3(target)):
        assert isinstance(drafter, LearnedDrafter)
        assert check_drafter(drafter) is drafter


def test_an_eagle3_generation_changes_only_when_a_tensor_is_replaced(target):
    drafter = _eagle3(target)
    before = drafter.refresh_inference()
    with torch.no_grad():
        drafter.fc.weight.mul_(0.5)  # an optimizer step: in place
    assert drafter.refresh_inference() == before
    drafter.fc.weight = torch.nn.Parameter(drafter.fc.weight.detach().clone())
    assert drafter.refresh_inference() != before


@pytest.mark.parametrize("graphs", [False, True])
def test_an_eagle3_drafter_rolls_out_the_plain_greedy_tokens(target, graphs):
    requests = [Request(p, SamplingParams(temperature=0.0, max_tokens=10)) for p in PROMPTS[:4]]
    config = EngineConfig(max_batch=4, max_len=40, graphs=graphs)
    plain = RolloutEngine(target, config).generate(requests)
    speculative = RolloutEngine(target, config, _eagle3(target)).generate(
        requests, Strategy(3, 2, 5))
    assert speculative.spec_steps
    assert [r.tokens.tolist() for r in speculative.rollouts] == [
        r.tokens.tolist() for r in plain.rollouts]


class _Delegate:
    """A drafter's members, all but `missing`; callable only as _CallableDelegate."""

    def __init__(self, drafter, missing: str, config=None):
        self._drafter, self._missing, self._config = drafter, missing, config

    def __getattr__(self, name):
        if name == self._missing or name.startswith("__"):
            raise AttributeError(name)
        if name == "config" and self._config is not None:
            return self._config
        return getattr(self._drafter, name)


class _CallableDelegate(_Delegate):
    def __call__(self, *args, **kwargs):
        return self._drafter(*args, **kwargs)


@pytest.mark.parametrize("missing", ["refresh_inference", "reserve_positions", "features",
                                     "draft_to_target"])
def test_a_drafter_lacking_a_member_is_refused_by_name(target, missing):
    drafter = Drafter(target)
    assert check_drafter(_CallableDelegate(drafter, "")) is not None  # the stand-in is whole
    with pytest.raises(TypeError, match=f"drafter: _CallableDelegate .* has no {missing} "):
        RolloutEngine(target, EngineConfig(max_batch=2, max_len=16),
                      _CallableDelegate(drafter, missing))


def test_a_drafter_that_cannot_be_called_or_lacks_feature_layers_is_refused(target):
    drafter = Drafter(target)
    with pytest.raises(TypeError, match="drafter: _Delegate .* has no __call__ "):
        RolloutEngine(target, EngineConfig(max_batch=2, max_len=16), _Delegate(drafter, ""))
    no_layers = _CallableDelegate(drafter, "", config=types.SimpleNamespace(form="eagle"))
    with pytest.raises(TypeError, match="has no config.feature_layers "):
        RolloutEngine(target, EngineConfig(max_batch=2, max_len=16), no_layers)
