"""The rollout engine: equals a naive generate loop (greedy and sampled with the same
generators), rows are independent of each other and of batching, the same seed gives the same
output, returned log-probs equal the model's recomputation, bad requests fail clearly."""

import pytest
import torch

from tlt_core.engine import (EngineConfig, Request, RolloutEngine, SamplingParams, sample_roots,
                             sample_seed)
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.ops import reference

VOCAB = 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)).eval()
    with torch.no_grad():  # sharper logits than init, so sampling is not uniform noise
        m.lm_head.weight.mul_(8)
    return m


def naive_generate(model, prompt, params, seed, stop_ids=()):
    """Recompute the whole sequence every token; sample with the same per-sample stream."""
    ids, tokens = list(prompt), []
    with torch.no_grad():
        for offset in range(params.max_tokens):
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[:, -1]
            token, _ = sample_roots(
                logits, torch.tensor([ids[-1]]), temperature=torch.tensor([params.temperature]),
                top_k=torch.tensor([params.top_k], dtype=torch.int32),
                top_p=torch.tensor([params.top_p]), seed=torch.tensor([seed]),
                offset=torch.tensor([offset]))
            ids.append(int(token[0]))
            tokens.append(int(token[0]))
            if tokens[-1] in stop_ids:
                break
    return tokens


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13, 14, 15]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=1.0, max_tokens=12, stop_ids=(3,)),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=12),
], ids=["greedy", "sampled", "top-k-top-p"])
def test_engine_equals_naive_generate_loop(model, params):
    engine = RolloutEngine(model, EngineConfig(max_batch=3, max_len=32, seed=5))
    result = engine.generate([Request(p, params) for p in PROMPTS])
    for rollout in result.rollouts:
        seed = sample_seed(5, rollout.request_index, rollout.sample_index)
        want = naive_generate(model, PROMPTS[rollout.request_index], params, seed, params.stop_ids)
        assert rollout.tokens.tolist() == want
        assert rollout.finish_reason == ("stop" if want[-1] in params.stop_ids else "length")


def test_rows_are_independent_of_batching_and_seeded(model):
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=None)
    requests = [Request(p, params) for p in PROMPTS]
    together = RolloutEngine(model, EngineConfig(max_batch=8, max_len=32)).generate(requests)
    one_row = RolloutEngine(model, EngineConfig(max_batch=1, max_len=32)).generate(requests)
    again = RolloutEngine(model, EngineConfig(max_batch=3, max_len=32)).generate(requests)
    for a, b, c in zip(together.rollouts, one_row.rollouts, again.rollouts):
        assert a.tokens.tolist() == b.tokens.tolist() == c.tokens.tolist()
    other_seed = RolloutEngine(model, EngineConfig(max_batch=8, max_len=32, seed=1)).generate(requests)
    assert any(a.tokens.tolist() != b.tokens.tolist()
               for a, b in zip(together.rollouts, other_seed.rollouts))
    # An explicit request seed fixes the samples whatever the engine's seed.
    pinned = [Request(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=10, seed=99))]
    first = RolloutEngine(model, EngineConfig(seed=0, max_len=32)).generate(pinned)
    second = RolloutEngine(model, EngineConfig(seed=7, max_len=32)).generate(pinned)
    assert first.rollouts[0].tokens.tolist() == second.rollouts[0].tokens.tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=15),
                                    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=15),
                                    SamplingParams(temperature=0.0, max_tokens=15)],
                         ids=["T1", "T0.8-p0.9", "greedy"])
def test_logprobs_equal_full_sequence_recomputation(model, params):
    result = RolloutEngine(model, EngineConfig(max_batch=4, max_len=32)).generate(
        [Request(p, params) for p in PROMPTS])
    for rollout in result.rollouts:
        ids = list(rollout.prompt_ids) + rollout.tokens.tolist()
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0]
        start = len(rollout.prompt_ids) - 1
        logprobs = reference.processed_logprobs(logits[start:start + len(rollout.tokens)],
                                                params.temperature, params.top_k, params.top_p)
        want = logprobs.gather(1, rollout.tokens[:, None])[:, 0]
        torch.testing.assert_close(rollout.logprobs, want, atol=1e-4, rtol=0)


def test_running_batch_trace_shows_the_tail(model):
    requests = [Request([1, 2], SamplingParams(temperature=0.0, max_tokens=m))
                for m in (2, 4, 8, 30)]
    result = RolloutEngine(model, EngineConfig(max_batch=4, max_len=40)).generate(requests)
    running = result.trace_running.tolist()
    assert running[0] == 4 and running[-1] == 1
    assert running == sorted(running, reverse=True)
    assert result.decode_steps == len(running) == 29  # the first token comes from prefill
    ends = result.trace_time_s.tolist()  # the step trace's end times, in step order
    assert ends == [o.ended_s for o in result.step_trace] == sorted(ends)
    assert 0 < ends[0] and ends[-1] <= result.total_s
    assert all(end - start >= o.seconds  # a step's own time fits between the ends
               for start, end, o in zip([0.0] + ends, ends, result.step_trace))
    assert not result.trace_speculative.any() and len(result.trace_speculative) == 29
    assert [len(r.tokens) for r in result.rollouts] == [2, 4, 8, 30]
    assert all(r.timing.admitted_s <= r.timing.first_token_s <= r.timing.finished_s
               for r in result.rollouts)


def test_observe_hook_sees_every_step_of_plain_decoding(model):
    requests = [Request([1, 2], SamplingParams(temperature=0.0, max_tokens=m)) for m in (3, 6)]
    steps = []
    result = RolloutEngine(model, EngineConfig(max_batch=2, max_len=16)).generate(
        requests, observe=lambda step: steps.append(
            (step.batch, step.plan, step.emitted, step.seconds > 0)))
    assert steps == [(2, None, 2, True)] * 2 + [(1, None, 1, True)] * 3
    assert result.decode_steps == len(steps)


def test_continuous_batching_admits_waiting_samples(model):
    requests = [Request([3, 4], SamplingParams(temperature=0.0, max_tokens=m)) for m in (3, 9, 2, 5)]
    result = RolloutEngine(model, EngineConfig(max_batch=2, max_len=16)).generate(requests)
    assert [len(r.tokens) for r in result.rollouts] == [3, 9, 2, 5]
    assert max(result.trace_running.tolist()) == 2


def test_bad_requests_fail_clearly(model):
    engine = RolloutEngine(model, EngineConfig(max_batch=2, max_len=16))
    with pytest.raises(ValueError, match="prompt_ids"):
        Request([], SamplingParams())
    with pytest.raises(ValueError, match="max_len"):
        engine.generate([Request(list(range(10)), SamplingParams(max_tokens=10))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([Request([VOCAB + 3], SamplingParams(max_tokens=2))])
    with pytest.raises(TypeError, match=r"requests\[0\]"):
        engine.generate([[1, 2]])
    for bad, pattern in [(dict(temperature=-1.0), "temperature"),
                         (dict(temperature=1e-42), "temperature"), (dict(top_p=0.0), "top_p"),
                         (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n:")]:
        with pytest.raises(ValueError, match=pattern):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(max_batch=0)
    from tlt_core.model.kv_cache import CacheBudgetError
    with pytest.raises(CacheBudgetError, match="budget_bytes"):
        RolloutEngine(model, EngineConfig(max_batch=64, max_len=4096, cache_budget_bytes=1 << 20))


def test_a_policy_is_told_every_step_it_chose_and_an_observer_every_step(model):
    """A PlanPolicy gets the outcome of each step it chose; an explicit observer too."""
    requests = [Request([1, 2], SamplingParams(temperature=0.0, max_tokens=m)) for m in (3, 5)]

    class Plain:  # a PlanPolicy that never speculates
        def __init__(self):
            self.chosen, self.contexts, self.told = [], [], []

        def start_call(self):
            self.calls = getattr(self, "calls", 0) + 1

        def choose(self, batch, context):
            self.chosen.append(batch)
            self.contexts.append(context)
            return None

        def observe(self, outcome):
            self.told.append((outcome.batch, outcome.plan, outcome.emitted))

    policy, seen = Plain(), []
    result = RolloutEngine(model, EngineConfig(max_batch=2, max_len=16)).generate(
        requests, policy, observe=lambda step: seen.append(step.batch))
    assert policy.chosen == seen == [2, 2, 1, 1] == [b for b, _, _ in policy.told]
    assert all(plan is None for _, plan, _ in policy.told)
    assert result.decode_steps == 4
    assert policy.calls == 1
    # mean tokens in the cache: the prompt's 2 (the first token is the first step's root),
    # then one more per step
    assert policy.contexts == [2, 3, 4, 5]
    assert [(o.step, o.batch, o.context, o.arm, o.emitted) for o in result.step_trace] == [
        (0, 2, 2, "plain", 2), (1, 2, 3, "plain", 2), (2, 1, 4, "plain", 1),
        (3, 1, 5, "plain", 1)]
    assert all(o.seconds > 0 and o.catch_up_s == 0 for o in result.step_trace)


def test_one_call_at_a_time_and_distinct_request_ids(model):
    engine = RolloutEngine(model, EngineConfig(max_batch=2, max_len=16))
    requests = [Request([1, 2], SamplingParams(temperature=0.0, max_tokens=3))]

    def reentrant(batch):  # a policy that calls back into the engine
        engine.generate(requests)

    with pytest.raises(RuntimeError, match="one call at a time"):
        engine.generate(requests, reentrant)
    assert engine.generate(requests).rollouts  # the refused call left the engine usable
    with pytest.raises(ValueError, match="request_ids: ids must be distinct"):
        engine.generate(requests * 2, request_ids=[4, 4])
