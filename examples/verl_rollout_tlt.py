"""veRL's rollout interface generating with tlt_core's engine, on the embedded model and its
drafter (CPU, seconds; no download).

    python examples/verl_rollout_tlt.py
    python examples/verl_rollout_tlt.py --prompts 16 --samples 8 --strategy "(6,1,7)"

Most of the default run's time (about a minute on 2 CPU cores) is the adaptive loop's one-off
calibration at batch sizes up to max_batch (32); `--max-batch 4` makes it seconds.

veRL (0.9) picks a rollout by name: `actor_rollout_ref.rollout.name: tlt` in
examples/configs/verl_rollout_tlt.yaml, found in veRL's registry once
`tlt_core.integrations.verl.registration` is imported. This script does what veRL's rollout
worker does with it: the class from `get_rollout_class(name, mode)`, built from veRL's own
RolloutConfig and HFModelConfig; a GRPO batch as veRL's trainer makes it (left-padded prompts,
each repeated `--samples` times, interleaved) in a DataProto; `generate_sequences`; then the
sleep / weight sync / wake sequence of veRL's `update_weights` (release, resume weights, stream
(name, tensor) pairs, resume the KV cache).

What it proves (asserted; a failure exits non-zero):

1. Lossless: a validation batch (greedy, val_kwargs.do_sample false) returns exactly the tokens
   plain decoding gives, although the adaptive loop drafted with the embedded drafter.
2. Log-probs agree: on the sampled GRPO batch, `rollout_log_probs` equal the target's own
   recomputation on the returned sequences (max |difference| below 1e-4, float32).
3. Weight sync reaches generation: after the actor's weights (here the target with one layer
   perturbed, standing in for an optimizer step) are streamed in during sleep, greedy tokens
   are the new weights' plain tokens and differ from the old ones.

It prints the rollout's metrics (`rollout/...`, `spec/acceptance_length`, ...) and the reward
of the embedded task's checker.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

TOLERANCE = 1e-4  # float32 log-probs of the same model, a verify pass vs. one full forward
CONFIG = Path(__file__).resolve().parent / "configs" / "verl_rollout_tlt.yaml"


def verl_batch(prompt_ids: list[list[int]], pad_id: int, eos_id: int, **meta_info):
    """Prompts as veRL's trainer gives them to a rollout: left-padded input_ids, attention_mask,
    position_ids counting over each prompt, sampling options in meta_info."""
    from verl import DataProto

    from tlt_core.integrations.verl import left_padded_prompts

    return DataProto.from_dict(left_padded_prompts(prompt_ids, pad_id),
                               meta_info={"eos_token_id": eos_id, "pad_token_id": pad_id,
                                          **meta_info})


def responses(output) -> list[list[int]]:
    """Each row's response tokens (where veRL's attention mask marks them)."""
    width = output.batch["responses"].shape[1]
    mask = output.batch["attention_mask"][:, -width:].bool()
    return [row[keep].tolist() for row, keep in zip(output.batch["responses"], mask)]


def plain_greedy(target, prompt_ids, max_tokens: int, eos_id: int) -> list[list[int]]:
    """What plain decoding (no drafter) gives: the lossless reference."""
    from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_ids=(eos_id,))
    engine = RolloutEngine(target, EngineConfig(max_batch=len(prompt_ids),
                                                max_len=max(map(len, prompt_ids)) + max_tokens))
    return [r.tokens.tolist() for r in
            engine.generate([Request(ids, params) for ids in prompt_ids]).rollouts]


def logprob_gap(target, prompt_ids, output) -> float:
    """max |rollout_log_probs - the target's recomputation| over the response tokens."""
    gap = 0.0
    with torch.no_grad():
        for row, (prompt, response) in enumerate(zip(prompt_ids, responses(output))):
            ids = torch.tensor([prompt + response])
            logits = target(ids, torch.arange(ids.shape[1])[None]).logits[0].float()
            expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(
                1, torch.tensor(response)[:, None])[:, 0]
            got = output.batch["rollout_log_probs"][row, :len(response)]
            gap = max(gap, float((got - expected).abs().max()))
    return gap


def actor_step(target, seed: int = 0):
    """The weights an actor would send after an update, in HF naming: the target's, with one
    layer's MLP perturbed (a stand-in for an optimizer step)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {name: tensor.detach().clone() for name, tensor in target.state_dict().items()}
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] += 0.5 * torch.randn(weights[name].shape, generator=generator)
    return weights


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (rollout.n)")
    parser.add_argument("--strategy", default=None,
                        help="engine_kwargs.tlt.strategy over the YAML's (adaptive)")
    parser.add_argument("--response-length", type=int, default=None,
                        help="rollout.response_length over the YAML's")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="engine_kwargs.tlt.max_batch over the YAML's (the adaptive loop "
                             "calibrates at batch sizes up to it)")
    args = parser.parse_args(argv)

    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    from tlt_core.embedded import TaskConfig, embedded_reward, generate_problems, load_embedded

    from tlt_core.integrations.verl.registration import register

    register()  # "tlt" in veRL's rollout registry (importing the module alone does it too)
    workload = load_embedded(progress=False)
    tokenizer = workload.tokenizer
    section = OmegaConf.load(CONFIG).actor_rollout_ref.rollout
    section.engine_kwargs.tlt.drafter = str(workload.drafter_folder)
    if args.strategy is not None:
        section.engine_kwargs.tlt.strategy = args.strategy
    if args.max_batch is not None:
        section.engine_kwargs.tlt.max_batch = args.max_batch
    if args.response_length is not None:
        section.response_length = args.response_length
    config = omega_conf_to_dataclass(section, RolloutConfig)
    rollout = get_rollout_class(config.name, config.mode)(
        config=config, device_mesh=None,
        model_config=HFModelConfig(path=str(workload.target_folder), load_tokenizer=False))

    problems = generate_problems(TaskConfig(seed=7, num_problems=args.prompts))
    prompt_ids = [tokenizer.prompt_ids(p.prompt) for p in problems]
    ids = dict(pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)

    # 1. a GRPO batch: each prompt repeated rollout.n times, interleaved, as veRL's trainer does
    batch = verl_batch(prompt_ids, **ids).repeat(args.samples, interleave=True)
    grpo = rollout.generate_sequences(batch)
    repeated = [p for p in prompt_ids for _ in range(args.samples)]
    gap = logprob_gap(rollout.target, repeated, grpo)
    answers = [p for p in problems for _ in range(args.samples)]
    rewards = [embedded_reward(p.prompt, tokenizer.decode_response(r), p.answer)
               for p, r in zip(answers, responses(grpo))]

    # 2. a validation batch: greedy, with speculation on, equals plain decoding
    greedy = responses(rollout.generate_sequences(verl_batch(prompt_ids, validate=True, **ids)))
    reference = plain_greedy(rollout.target, prompt_ids, config.response_length, tokenizer.eos_id)

    # 3. veRL's update_weights sequence: sleep, weights in, wake; then greedy again
    new_weights = actor_step(rollout.target)
    asyncio.run(rollout.release())
    asyncio.run(rollout.resume(tags=["weights"]))
    asyncio.run(rollout.update_weights(iter(new_weights.items()), global_steps=1))
    asyncio.run(rollout.resume(tags=["kv_cache"]))
    synced = responses(rollout.generate_sequences(verl_batch(prompt_ids, validate=True, **ids)))
    synced_reference = plain_greedy(rollout.target, prompt_ids, config.response_length,
                                    tokenizer.eos_id)

    result = {"metrics": grpo.meta_info["metrics"], "logprob_gap_max": gap,
              "reward_mean": sum(rewards) / len(rewards), "greedy_equal": greedy == reference,
              "synced_equal": synced == synced_reference, "sync_changed": synced != greedy,
              "rows": len(repeated)}
    for name, value in sorted(result["metrics"].items()):
        print(f"{name:32s} {value:.4g}")
    print(f"{'reward (embedded checker)':32s} {result['reward_mean']:.3f}")
    print(f"{'log-prob gap (max)':32s} {gap:.2e}")
    assert result["greedy_equal"], "greedy rollout differs from plain decoding"
    assert gap < TOLERANCE, f"rollout log-probs differ from the recomputation by {gap:.2e}"
    assert result["synced_equal"], "after the weight sync, greedy differs from the new weights'"
    assert result["sync_changed"], "the weight sync did not change what is generated"
    print("ok: lossless greedy, log-probs agree, weight sync reaches generation")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
