"""The TRL adapter's contracts beyond the example: a LoRA policy generates with its merged
weights (the engine's log-probs equal the PEFT model's), a precision gap between the engine and
TRL's recomputation is named, and `use_tlt=True` in TRL's config selects the engine."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from tests.test_examples import StandInTrainer, _tiny_model, load_example

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # fp32, the same weights in two implementations: ~1e-6


def _peft_model(seed: int):
    pytest.importorskip("peft")
    from peft import get_peft_model

    example = load_example("trl_grpo_tlt")
    return get_peft_model(example._hf_model(example.tiny_target(seed)), example._lora_config())


def _randomize_lora_(model, seed: int) -> None:
    """An optimizer's work on the adapters, by hand: lora_B starts at zero, so untouched
    adapters would leave the merged weights equal to the base model's."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))


def _peft_logprobs(model, prompt_ids, completion_ids) -> list[torch.Tensor]:
    """log p(completion token | prefix) under model's own forward, one row at a time."""
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids):
            sequence = torch.tensor([prompt + completion])
            logits = model(input_ids=sequence).logits[0, len(prompt) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(completion)[:, None])[:, 0])
    return out


def _max_gap(out, reference) -> float:
    return max(float((torch.tensor(ours) - theirs).abs().max())
               for ours, theirs in zip(out["logprobs"], reference))


def test_lora_policy_engine_logprobs_equal_the_peft_models_at_every_sync():
    from tlt_core.integrations import TLTRollout

    model = _peft_model(0)
    _randomize_lora_(model, 1)
    base_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    trainer = StandInTrainer(model)
    rollout = TLTRollout(strategy=None)  # the target is built from the (merged) PEFT model
    prompts = ["12+34"] * 3 + ["56+78"] * 3

    out = rollout(prompts, trainer)
    assert _max_gap(out, _peft_logprobs(model, out["prompt_ids"], out["completion_ids"])) \
        < TOLERANCE
    with model.disable_adapter():  # control: the adapters matter for these log-probs
        base = _peft_logprobs(model, out["prompt_ids"], out["completion_ids"])
    assert _max_gap(out, base) > 100 * TOLERANCE

    _randomize_lora_(model, 2)  # a training step on the adapters, then TRL's step counter
    trainer.state.global_step = 1
    out = rollout(prompts, trainer)
    assert rollout.calls[-1].weights_step == 1
    assert _max_gap(out, _peft_logprobs(model, out["prompt_ids"], out["completion_ids"])) \
        < TOLERANCE
    # the merge went into the engine's copy: the trainer's model is unmerged and unchanged
    for name, parameter in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(parameter, base_before[name]), name
    assert not any(getattr(m, "merged_adapters", None) for m in model.modules())


def test_merged_weights_refuse_what_a_merge_cannot_carry():
    pytest.importorskip("peft")
    from peft import LoraConfig, PrefixTuningConfig, get_peft_model

    from tlt_core.integrations.peft_weights import merged_weights

    example = load_example("trl_grpo_tlt")
    dora = get_peft_model(example._hf_model(example.tiny_target(0)),
                          LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="DoRA"):
        merged_weights(dora)
    prefix = get_peft_model(example._hf_model(example.tiny_target(0)),
                            PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match="PrefixTuningConfig"):
        merged_weights(prefix)
    # the tiny model ties its embedding and head: a LoRA on one cannot be merged into both
    tied = get_peft_model(example._hf_model(example.tiny_target(0)),
                          LoraConfig(r=2, target_modules=["embed_tokens"]))
    _randomize_lora_(tied, 0)
    with pytest.raises(ValueError, match="embed_tokens"):
        merged_weights(tied)


def _precision_warnings(trainer, target) -> list[str]:
    from tlt_core.integrations import TLTRollout

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TLTRollout(target, strategy=None)(["12+34"] * 2, trainer)
    return [str(w.message) for w in caught if "computes log-probs in" in str(w.message)]


def test_a_precision_gap_with_trls_recomputation_is_named_with_its_dtypes_and_the_fix():
    policy = _tiny_model(0)
    bf16_args = SimpleNamespace(generation_kwargs=None, bf16=True, fp16=False)
    [message] = _precision_warnings(StandInTrainer(policy, args=bf16_args), _tiny_model(1))
    assert "float32" in message and "bfloat16 autocast" in message
    assert "bf16=True (TRL's default)" in message and "Set bf16=False" in message

    [message] = _precision_warnings(StandInTrainer(policy), _tiny_model(1).to(torch.bfloat16))
    assert "log-probs in torch.bfloat16" in message and "float32 target" in message

    assert _precision_warnings(StandInTrainer(policy), _tiny_model(1)) == []  # fp32 both


def test_a_drafter_folder_is_loaded_onto_the_target_built_from_the_trainers_model(tmp_path):
    from tlt_core.drafting.drafter import Drafter
    from tlt_core.drafting.tree import Strategy
    from tlt_core.integrations import TLTRollout

    example = load_example("trl_grpo_tlt")
    saved = Drafter(example.tiny_target(0))
    saved.save(tmp_path / "drafter")
    rollout = TLTRollout(drafter=tmp_path / "drafter", strategy=Strategy(3, 1, 4))
    rollout(["12+34"] * 2, StandInTrainer(example._hf_model(example.tiny_target(0))))
    assert isinstance(rollout.drafter, Drafter) and rollout.drafter.target is rollout.target
    for name, value in saved.state_dict().items():
        assert torch.equal(rollout.drafter.state_dict()[name], value), name
    assert rollout.calls[-1].sd_steps > 0


# ---- selecting the engine from TRL's config -------------------------------------------------


@pytest.fixture
def trl_trainer_module():
    pytest.importorskip("trl")
    from tlt_core.integrations import trl_trainer

    return trl_trainer


@pytest.mark.parametrize("overrides, named", [
    ({"tlt_strategy": "fastest"}, "tlt_strategy"),
    ({"tlt_max_batch": 0}, "tlt_max_batch"),
    ({"use_transformers_continuous_batching": True}, "use_tlt"),
])
def test_tlt_grpo_config_names_a_bad_field(trl_trainer_module, tmp_path, overrides, named):
    with pytest.raises(ValueError, match=named):
        trl_trainer_module.TLTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                         use_tlt=True, **overrides)


def test_tlt_grpo_config_fields_become_the_rollout(trl_trainer_module, tmp_path):
    from tlt_core.drafting.tree import Strategy

    config = trl_trainer_module.TLTGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, use_tlt=True, tlt_strategy="(3,1,4)",
        tlt_max_batch=6, seed=7, tlt_check_logprobs=True)
    rollout = trl_trainer_module.rollout_from_config(config)
    assert rollout.policy == Strategy(3, 1, 4) and rollout.engine_config.max_batch == 6
    assert rollout.seed == 7 and rollout.check_logprobs
    plain = trl_trainer_module.TLTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                             use_tlt=True, tlt_strategy="none")
    assert trl_trainer_module.rollout_from_config(plain).policy is None


def test_use_tlt_in_grpo_config_makes_the_engine_trls_generator(trl_trainer_module, tmp_path,
                                                                monkeypatch):
    pytest.importorskip("datasets")
    from datasets import Dataset

    from tlt_core.bench.peers import _char_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    example = load_example("trl_grpo_tlt")
    config = trl_trainer_module.TLTGRPOConfig(
        output_dir=str(tmp_path), use_tlt=True, tlt_strategy="none", tlt_check_logprobs=True,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, max_steps=1, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False)
    trainer = trl_trainer_module.TLTGRPOTrainer(
        model=example._hf_model(example.tiny_target(0)),
        reward_funcs=example.digit_share_reward, args=config,
        train_dataset=Dataset.from_list([{"prompt": "12+34?"}]),
        processing_class=_char_tokenizer())
    assert trainer.rollout_func is trainer.tlt_rollout
    trainer.train()
    [call] = trainer.tlt_rollout.calls
    assert call.samples == 4 and call.logprob_gap_max < TOLERANCE
    assert any("rollout/time_s" in entry for entry in trainer.state.log_history)

    with pytest.raises(ValueError, match="rollout_func"):
        trl_trainer_module.TLTGRPOTrainer(model=example._hf_model(example.tiny_target(0)),
                                          reward_funcs=example.digit_share_reward, args=config,
                                          rollout_func=lambda prompts, trainer: {})


def test_trl_trains_lora_adapters_and_the_engine_generates_with_them():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    pytest.importorskip("peft")
    module = load_example("trl_grpo_tlt")
    result = module.main(["--lora"])  # peft_config given to GRPOTrainer; asserts itself
    assert [c.weights_step for c in result["calls"]] == [0, 1]
    assert all(c.logprob_gap_max < module.TOLERANCE for c in result["calls"])
    assert all(gap > 10 * module.TOLERANCE for gap in result["stale_gaps"])
