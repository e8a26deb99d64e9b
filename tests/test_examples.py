"""The embedding examples under examples/ run, small, in-process, and their own asserts hold (what
each proves is in its docstring and docs/embedding.md); the TRL adapter keeps its contract
without TRL, through a stand-in trainer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ("dlpack_verify", "hf_batched_verify", "trl_grpo_tlt")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"tlt_examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_every_example_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example(name).main(["--help"])
    assert exit_info.value.code == 0
    assert "prove" in load_example(name).__doc__  # each says what it proves
    assert "usage:" in capsys.readouterr().out


def test_dlpack_verify_numpy_matches_reference_without_copies():
    result = load_example("dlpack_verify").main(["--batch", "6", "--nodes", "8", "--vocab", "32"])
    assert sum(result["greedy_num_accepted"]) > 0  # paths of several tokens were accepted
    assert result["cache_entries_moved"] > 0  # compact_kv_ wrote into the NumPy cache
    assert set(result["refused"]) == {"float64 logits", "non-contiguous logits"}
    assert result["cupy"] == "ok" or result["cupy"].startswith("skipped")


def test_hf_batched_verify_greedy_equals_generate_and_sampling_follows_target():
    pytest.importorskip("transformers")
    result = load_example("hf_batched_verify").main(
        ["--batch", "4", "--max-new-tokens", "12", "--check-rows", "2000"])
    assert result["greedy_equal"] and result["batch"] == 4
    assert len(set(result["lengths"])) > 1  # rows finished at different times
    assert result["acceptance_length_greedy"] > 1.0  # some drafts were accepted
    check = result["sampling_check"]
    assert check["p_value"] > 1e-3
    assert check["control_p_value"] < 1e-3  # the test tells q_draft from p_target


def test_trl_grpo_with_tlt_rollout_logprobs_agree_and_weights_sync():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    module = load_example("trl_grpo_tlt")
    result = module.main([])  # asserts both properties itself; restated here
    calls = result["calls"]
    assert [c.weights_step for c in calls] == [0, 1]
    assert all(c.logprob_gap_max < module.TOLERANCE for c in calls)
    assert all(gap > 10 * module.TOLERANCE for gap in result["stale_gaps"])
    assert all(c.sd_steps == c.decode_steps > 0 for c in calls)  # every step speculative
    assert result["logs"] and "spec/acceptance_length" in result["logs"][0]


# ---- TLTRollout's contract with a stand-in for TRL's trainer ----------------------------------


def _tiny_model(seed: int):
    from tlt_core.model.transformer import ModelConfig, Transformer

    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=19, hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                    tie_word_embeddings=True))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                torch.nn.init.normal_(parameter, std=0.2)
    return model.eval()


class StandInTrainer:
    """What TLTRollout reads from TRL's GRPOTrainer. Its model is another tlt_core Transformer:
    the parameter names are the same as a transformers model's."""

    def __init__(self, model, **overrides):
        from tlt_core.embedded.task import CharTokenizer

        self.model, self.tokenizer = model, CharTokenizer()
        self.accelerator = SimpleNamespace(unwrap_model=lambda m: m, process_index=0)
        self.state = SimpleNamespace(global_step=0)
        self.args = SimpleNamespace(generation_kwargs=None)
        self.temperature, self.top_k, self.top_p, self.min_p = 1.0, 0, 1.0, None
        self.repetition_penalty, self.use_vllm, self.tools = 1.0, False, None
        self.max_completion_length, self.eos_token_ids = 6, [self.tokenizer.eos_id]
        self.logged: list[tuple[str, float]] = []
        vars(self).update(overrides)

    def _tokenize_prompts(self, prompts):
        return [self.tokenizer.prompt_ids(p) for p in prompts], None, {}

    def _log_metric(self, name, value):
        self.logged.append((name, value))


def test_tlt_rollout_returns_one_completion_per_prompt_and_syncs_weights_on_step():
    from tlt_core.integrations import TLTRollout
    from tlt_core.drafting.tree import Strategy

    trainer = StandInTrainer(_tiny_model(0))
    rollout = TLTRollout(_tiny_model(1), strategy=None)
    prompts = ["12+34"] * 3 + ["56+78"] * 3  # TRL's RepeatSampler: groups of num_generations
    out = rollout(prompts, trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}
    assert out["prompt_ids"] == [trainer.tokenizer.prompt_ids(p) for p in prompts]
    assert [len(c) for c in out["completion_ids"]] == [len(lp) for lp in out["logprobs"]]
    assert all(1 <= len(c) <= 6 for c in out["completion_ids"])
    for name, value in rollout.target.state_dict().items():  # synced at the first call
        assert torch.equal(value, trainer.model.state_dict()[name])

    again = rollout(prompts, trainer)  # a new call draws new samples
    assert again["completion_ids"] != out["completion_ids"]
    with torch.no_grad():  # an optimizer step, seen only once the global step moves
        trainer.model.model.embed_tokens.weight.add_(0.5)
    rollout(prompts, trainer)
    assert rollout.calls[-1].weights_step == 0
    assert not torch.equal(rollout.target.model.embed_tokens.weight,
                           trainer.model.model.embed_tokens.weight)
    trainer.state.global_step = 1
    rollout(prompts, trainer)
    assert rollout.calls[-1].weights_step == 1
    assert torch.equal(rollout.target.model.embed_tokens.weight,
                       trainer.model.model.embed_tokens.weight)
    assert any(name == "rollout/time_s" for name, _ in trainer.logged)

    # greedy rows are reproducible and SD does not change them
    greedy = StandInTrainer(trainer.model, temperature=0.0)
    from tlt_core.drafting.drafter import Drafter

    target = _tiny_model(2)
    plain = TLTRollout(target, strategy=None)(prompts, greedy)["completion_ids"]
    speculative = TLTRollout(target, drafter=Drafter(target), strategy=Strategy(3, 1, 4))
    spec = speculative(prompts, greedy)
    assert spec["completion_ids"] == plain
    # acceptance by context position: the short responses all fall in the first bucket
    call = speculative.calls[-1]
    assert call.acceptance_by_position["0-256"] == pytest.approx(call.acceptance_length)
    assert ("spec/acceptance_length/0-256", call.acceptance_length) in greedy.logged
    assert not any(name.endswith("1k+") for name, _ in greedy.logged)  # no row got there


def test_tlt_rollout_adaptive_policy_is_calibrated_at_the_first_call():
    from tlt_core.adaptive.policy import AdaptivePolicy
    from tlt_core.drafting.drafter import Drafter
    from tlt_core.integrations import TLTRollout

    target = _tiny_model(3)
    rollout = TLTRollout(target, drafter=Drafter(target))  # "adaptive" by default
    out = rollout(["12+34"] * 4 + ["56+78"] * 4, StandInTrainer(_tiny_model(0)))
    assert isinstance(rollout.policy, AdaptivePolicy)
    assert rollout.engine.config.max_batch == 8  # the call's samples, unless configured
    assert len(out["completion_ids"]) == 8


@pytest.mark.parametrize("setting, value, named", [
    ("use_vllm", True, "use_vllm"), ("repetition_penalty", 1.2, "repetition_penalty"),
    ("min_p", 0.1, "min_p"), ("tools", [print], "tools"),
])
def test_tlt_rollout_names_unsupported_trainer_settings(setting, value, named):
    from tlt_core.integrations import TLTRollout

    trainer = StandInTrainer(_tiny_model(0), **{setting: value})
    with pytest.raises(ValueError, match=named):
        TLTRollout(strategy=None)(["12+34"], trainer)
