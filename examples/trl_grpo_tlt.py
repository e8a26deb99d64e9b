"""TRL's GRPOTrainer with tlt_core's rollout engine as its generator (`rollout_func`).

    python examples/trl_grpo_tlt.py                    # tiny random model, toy reward, seconds
    python examples/trl_grpo_tlt.py --model embedded   # the pre-trained embedded model and
                                                       # its drafter on the embedded task,
                                                       # adaptive SD (about a minute)
    python examples/trl_grpo_tlt.py --lora             # TRL trains LoRA adapters
                                                       # (peft_config); the engine generates
                                                       # with the merged weights

TRL (1.16) trains: its dataloader, rewards, advantages, loss and optimizer are untouched. Only
generation is ours: `tlt_core.integrations.TLTRollout` syncs the trainer's weights into the
engine's target when TRL's global step moved, tokenizes the prompts with TRL's own code, and
generates each GRPO group with the engine — speculatively (the embedded EAGLE drafter under the
adaptive policy for the embedded model; a fixed chain Strategy(3, 1, 4) with an untrained
drafter for the tiny one, which is slow to accept but exactly as lossless).

What it proves (asserted; a failure exits non-zero):

1. Log-probs agree: at every call, the log-probs the engine returned equal TRL's own
   recomputation of them (`_get_per_token_logps_and_entropies`, the function behind TRL's
   `old_per_token_logps`) on the same completions, max |difference| below 1e-4, with TRL
   training in fp32 (`bf16=False`). TRL's default, `bf16=True`, runs its forwards under bf16
   autocast while the engine stays fp32; `--bf16` shows that gap (reported, not asserted).
2. TRL's updates reach the engine on the next step: the engine's weights at call k equal the
   trainer model's weights after optimizer step k - 1 (with --lora: base + B @ A * scaling,
   merged without touching the trainer's model), bit for bit, and differ from those of
   call k - 1. As a control, the log-probs the previous step's weights give call k's
   completions are off by far more than the tolerance (printed as the "stale gap"): the
   agreement in 1 could not hold with unsynced weights.
3. The run works end to end: `--steps` GRPO steps, TRL's metrics logged with ours
   (`spec/acceptance_length`, `rollout/sampling_logp_difference/max`, ...).

The tiny model's reward is a toy (the share of digits in the completion): a random model never
solves the task, and GRPO with all-equal rewards has zero advantages, so the weights would not
move and check 2 would prove nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from tlt_core.model.checkpoint import save_checkpoint
from tlt_core.model.transformer import ModelConfig, Transformer
from tlt_core.embedded.task import CharTokenizer, TaskConfig, generate_problems

TOLERANCE = 1e-4  # fp32 logits of two implementations of the same model differ by ~1e-6


def tiny_target(seed: int = 0) -> Transformer:
    """A random 2-layer Llama-style model over the embedded task's 19-token vocabulary, its
    matrices N(0, 0.2): about 2.4 nats per token, so a GRPO group's samples differ."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, tie_word_embeddings=True, max_position_embeddings=256)
    model = Transformer(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:  # the default N(0, 1) embedding makes a tied head one-hot
                torch.nn.init.normal_(parameter, std=0.2)
    return model.eval()


def digit_share_reward(prompts, completions, **kwargs) -> list[float]:
    """Toy reward for the tiny model: the share of digits among the completion's characters."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _hf_model(target: Transformer):
    """The target as a transformers model, through our checkpoint format."""
    from transformers import AutoModelForCausalLM

    tokenizer = CharTokenizer()
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(target, folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, value in (("eos_token_id", tokenizer.eos_id), ("pad_token_id", tokenizer.pad_id),
                        ("bos_token_id", tokenizer.bos_id)):
        setattr(model.generation_config, name, value)
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (default 2)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    parser.add_argument("--generations", type=int, default=4,
                        help="samples per prompt, TRL's num_generations (default 4)")
    parser.add_argument("--max-completion-length", type=int, default=None,
                        help="default 12 (tiny), 128 (embedded)")
    parser.add_argument("--lr", type=float, default=None,
                        help="default 1e-2 (tiny), 5e-5 (embedded)")
    parser.add_argument("--bf16", action="store_true",
                        help="train under bf16 autocast, TRL's default (the engine stays fp32): "
                             "shows the precision gap instead of asserting agreement")
    parser.add_argument("--lora", action="store_true",
                        help="train LoRA adapters (TRL's peft_config) on the attention and MLP "
                             "projections instead of every weight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tlt_core.bench.peers import _char_tokenizer
    from tlt_core.integrations import TLTRollout
    from tlt_core.integrations.peft_weights import merged_weights
    from tlt_core.drafting.tree import Strategy

    if args.model == "embedded":
        from tlt_core.embedded.workload import train_inputs, embedded_reward

        inputs = train_inputs(progress=True)
        target, drafter = inputs.policy, inputs.drafter
        strategy, lr, max_len = "adaptive", args.lr or 5e-5, args.max_completion_length or 128

        def reward(prompts, completions, answer, **kwargs):
            return [embedded_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]
    else:
        from tlt_core.drafting.drafter import Drafter

        target = tiny_target(args.seed)
        drafter = Drafter(target)  # untrained: few drafts accepted, every one verified
        strategy, lr, max_len = Strategy(3, 1, 4), args.lr or 1e-2, args.max_completion_length or 12
        reward = digit_share_reward

    problems = generate_problems(TaskConfig(seed=2024 + args.seed,
                                            num_problems=args.prompts * args.steps))
    # the char tokenizer's template adds <bos>; "?" ends a prompt, as CharTokenizer.prompt_ids
    dataset = Dataset.from_list([{"prompt": p.prompt + "?", "answer": p.answer} for p in problems])
    model = _hf_model(target)
    rollout = TLTRollout(target, drafter=drafter, strategy=strategy, seed=args.seed,
                         check_logprobs=True)

    engine_weights, generated = [], []

    def rollout_func(prompts, trainer):  # the adapter, plus what the checks below need
        out = rollout(prompts, trainer)
        engine_weights.append({k: v.detach().clone()
                               for k, v in rollout.target.state_dict().items()})
        generated.append(out)
        return out

    trainer_weights = []

    class AfterOptimizerStep(TrainerCallback):
        def on_step_end(self, _args, state, control, model=None, **kwargs):
            trainer_weights.append({k: v.clone() for k, v in merged_weights(model).items()})

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=args.prompts * args.generations,
            gradient_accumulation_steps=1, num_generations=args.generations,
            max_completion_length=max_len, temperature=1.0, top_k=0, top_p=1.0,
            learning_rate=lr, beta=0.0, max_steps=args.steps, logging_steps=1,
            report_to="none", use_cpu=True, save_strategy="no", seed=args.seed,
            disable_tqdm=True,
            # TRL defaults to bf16=True: accelerate then runs the trainer's forwards under bf16
            # autocast (on the CPU too) while the engine generates in fp32, and the two
            # log-probs differ by bf16 rounding (~0.05 here), not by anything SD does
            bf16=args.bf16)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                              train_dataset=dataset, processing_class=_char_tokenizer(),
                              rollout_func=rollout_func, callbacks=[AfterOptimizerStep()],
                              peft_config=_lora_config() if args.lora else None)
        trainer.remove_callback(PrinterCallback)  # TRL's raw log dicts; a summary follows
        trainer.train()
    logs = [h for h in trainer.state.log_history if "rollout/sampling_logp_difference/max" in h]

    # 1. log-probs agree with TRL's recomputation, every call (at the same precision)
    for k, call in enumerate(rollout.calls):
        assert args.bf16 or call.logprob_gap_max < TOLERANCE, (
            f"call {k}: engine log-probs differ from TRL's by {call.logprob_gap_max:.2e}")
    # 2. the weights TRL updates reach the engine on the next step
    stale_gaps = []
    for k in range(1, len(rollout.calls)):
        assert rollout.calls[k].weights_step == k, rollout.calls[k]
        for name, value in trainer_weights[k - 1].items():
            assert torch.equal(engine_weights[k][name], value.to(engine_weights[k][name])), (
                f"call {k}: the engine's {name} is not the trainer's after step {k - 1}")
        assert any(not torch.equal(engine_weights[k][n], engine_weights[k - 1][n])
                   for n in engine_weights[k]), f"call {k}: the engine's weights did not change"
        stale_gaps.append(_stale_gap(target.config, engine_weights[k - 1], generated[k]))
        assert stale_gaps[-1] > 10 * TOLERANCE, (
            f"call {k}: the previous weights give nearly the same log-probs "
            f"({stale_gaps[-1]:.2e}): the sync check would not notice stale weights")

    print(f"TRL GRPO, {args.steps} steps x {args.prompts} prompts x {args.generations} samples, "
          f"generated by tlt_core ({args.model} model{', LoRA' if args.lora else ''}, "
          f"strategy {strategy})")
    for k, call in enumerate(rollout.calls):
        accept = "-" if call.acceptance_length is None else f"{call.acceptance_length:.2f}"
        stale = f", stale gap {stale_gaps[k - 1]:.2e}" if k else ""
        print(f"  call {k}: weights of step {call.weights_step}, {call.samples} samples, "
              f"{call.tokens} tokens, acceptance length {accept}, SD steps "
              f"{call.sd_steps}/{call.decode_steps}, logprob gap max {call.logprob_gap_max:.2e}"
              f"{stale}")
    for entry in logs:
        print(f"  TRL log, step {entry.get('step', '?')}: "
              f"reward {entry.get('reward', float('nan')):.3f}, "
              f"rollout/sampling_logp_difference/max {entry['rollout/sampling_logp_difference/max']:.2e}, "
              f"spec/acceptance_length {entry.get('spec/acceptance_length', float('nan')):.2f}")
    return {"calls": rollout.calls, "stale_gaps": stale_gaps, "logs": logs}


def _lora_config():
    """Rank-4 LoRA on every projection; lora_B starts at zero, so the first call's engine
    weights are the base model's and the updates TRL makes afterwards are the adapters'."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _stale_gap(config: ModelConfig, weights: dict, generated: dict) -> float:
    """max |engine log-probs - log-probs under `weights`| over a call's completions."""
    from tlt_core.rl.losses import response_logprobs

    stale = Transformer(config)
    stale.load_state_dict(weights)
    gaps = []
    with torch.no_grad():
        for prompt, completion, logprobs in zip(generated["prompt_ids"],
                                                generated["completion_ids"], generated["logprobs"]):
            sequence = torch.tensor([prompt + completion])
            mask = torch.ones(1, len(completion))
            theirs = response_logprobs(stale.eval(), sequence, torch.tensor([len(prompt)]), mask)
            gaps.append(float((theirs[0] - torch.tensor(logprobs)).abs().max()))
    return max(gaps)


if __name__ == "__main__":
    main(sys.argv[1:])
