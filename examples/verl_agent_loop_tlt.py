"""veRL's own agent loop generating through the tlt server replica, on a local Ray cluster, with
SmolLM2-135M-Instruct (CPU, about a minute).

    python examples/verl_agent_loop_tlt.py

This is veRL 0.9's PPO generation path minus the trainer: veRL's `LLMServerManager` looks the
replica up by the rollout's name ("tlt", RolloutReplicaRegistry) and runs its `init_hybrid`
against a worker actor that holds the rollout, as veRL's fused actor/rollout worker does;
veRL's `AgentLoopWorker` applies the chat template and sends every sample to the replica's
server through veRL's load balancer and client, one request per sample.

What it proves (asserted; a failure exits non-zero):

1. Concurrent requests are batched: the 12 requests of the three batches take fewer engine
   calls than requests (one per batch when the agent loop sends a batch's requests within
   the server's collection window, tlt_core.integrations.verl.server.COLLECT_S).
2. Lossless: a validation batch (greedy) returns exactly the tokens plain decoding gives.
3. Log-probs agree: on a sampled GRPO batch, `rollout_log_probs` equal the target's own
   recomputation on the returned sequences (max |difference| below 1e-4, float32).
4. Sleep and wake: after the replica sleeps and the worker's update_weights wakes the rollout,
   greedy tokens are unchanged.

Needs veRL's agent-loop dependencies besides those docs/integrations.md lists for the rollout:
`cachetools`, `fastapi` and `uvicorn` (veRL's router and server modules import them), and
SmolLM2 converted into the tlt_core cache (tests/conftest.py, `smollm2_dir`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

TOLERANCE = 1e-4  # float32 log-probs of the same model, a verify pass vs. one full forward
QUESTIONS = ["What is 2+2?", "Name a color.", "Say hello in French."]


def verl_config(model: Path, samples: int, response_length: int):
    """veRL's PPO trainer config (its own ppo_trainer.yaml) with the rollout set to tlt."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        config = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.rollout.name=tlt",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.prompt_length=64",
            f"actor_rollout_ref.rollout.response_length={response_length}",
            f"actor_rollout_ref.rollout.n={samples}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "+actor_rollout_ref.rollout.engine_kwargs.tlt={strategy: 'suffix(4)', device: cpu}",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "trainer.n_gpus_per_node=1",
        ])
    OmegaConf.resolve(config)  # the worker actor gets the rollout section without its root
    return config


def rollout_worker_class():
    """A Ray actor holding the rollout as `.rollout`, as veRL's fused actor/rollout worker does
    (its update_weights resumes the KV cache, the part of veRL's weight sync a rollout sees)."""
    import ray

    @ray.remote
    class RolloutWorker:
        def __init__(self, rollout_section, model_section):
            from verl.utils.config import omega_conf_to_dataclass
            from verl.workers.config import HFModelConfig, RolloutConfig
            from verl.workers.rollout.base import get_rollout_class

            from tlt_core.integrations.verl.registration import register

            register()
            config = omega_conf_to_dataclass(rollout_section, RolloutConfig)
            self.rollout = get_rollout_class(config.name, config.mode)(
                config=config, model_config=omega_conf_to_dataclass(model_section, HFModelConfig),
                device_mesh=None)

        async def update_weights(self):
            await self.rollout.resume(tags=["kv_cache"])

    return RolloutWorker


def checks_on_worker(worker, rows: list[tuple[list[int], list[int], list[float]]]) -> dict:
    """Runs on the rollout worker: each row's plain greedy tokens and its log-prob gap against
    the target's recomputation. rows: (prompt ids, response ids, rollout log-probs)."""
    from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams

    rollout = worker.rollout
    target, config = rollout.target, rollout.config
    engine = RolloutEngine(target, EngineConfig(
        max_batch=len(rows), max_len=max(len(p) for p, _, _ in rows) + config.response_length))
    params = SamplingParams(temperature=0.0, max_tokens=config.response_length,
                            stop_ids=rollout.stop_ids)
    greedy = [r.tokens.tolist() for r in engine.generate(
        [Request(prompt, params) for prompt, _, _ in rows], None).rollouts]
    gap = 0.0
    with torch.no_grad():
        for prompt, response, logprobs in rows:
            ids = torch.tensor([prompt + response])
            logits = target(ids, torch.arange(ids.shape[1])[None]).logits[0]
            expected = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1].gather(
                1, torch.tensor(response)[:, None])[:, 0]
            gap = max(gap, float((expected - torch.tensor(logprobs)).abs().max()))
    return {"greedy": greedy, "logprob_gap": gap, "calls": rollout.calls}


def rows_of(output) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids, log-probs) of each row of the agent loop's output."""
    rows = []
    for row in range(len(output)):
        prompt_mask = output.batch["attention_mask"][row, :output.batch["prompts"].shape[1]]
        response_mask = output.batch["response_mask"][row].bool()
        rows.append((output.batch["prompts"][row][prompt_mask.bool()].tolist(),
                     output.batch["responses"][row][response_mask].tolist(),
                     output.batch["rollout_log_probs"][row][response_mask].tolist()))
    return rows


def agent_batch(samples: int, **meta_info):
    """A batch as veRL's trainer hands the agent loop: chat messages, each prompt repeated
    `samples` times (interleaved)."""
    from verl import DataProto

    raw = np.empty(len(QUESTIONS) * samples, dtype=object)
    for row in range(len(raw)):
        raw[row] = [{"role": "user", "content": QUESTIONS[row // samples]}]
    return DataProto.from_dict(non_tensors={"raw_prompt": raw, "index": np.arange(len(raw))},
                               meta_info=meta_info)


async def run(config, samples: int) -> dict:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerManager

    worker = rollout_worker_class().remote(config.actor_rollout_ref.rollout,
                                           config.actor_rollout_ref.model)
    manager = await LLMServerManager.create(
        config, worker_group=types.SimpleNamespace(workers=[worker], world_size=1))
    agent_loop = AgentLoopWorker(config, manager.get_client())

    validation = await agent_loop.generate_sequences(agent_batch(1, validate=True))
    sampled = await agent_loop.generate_sequences(agent_batch(samples))
    await manager.get_replicas()[0].sleep()
    await worker.update_weights.remote()  # veRL's weight sync wakes the rollout
    again = await agent_loop.generate_sequences(agent_batch(1, validate=True))

    validation_rows, sampled_rows = rows_of(validation), rows_of(sampled)
    greedy_check = await worker.__ray_call__.remote(checks_on_worker, validation_rows)
    sampled_check = await worker.__ray_call__.remote(checks_on_worker, sampled_rows)
    tokenizer = agent_loop.tokenizer
    for (_, response, _), question in zip(validation_rows, QUESTIONS):
        print(f"{question!r:26s} -> {tokenizer.decode(response)!r}")
    return {"greedy_equal": [r for _, r, _ in validation_rows] == greedy_check["greedy"],
            "wake_equal": [r[:2] for r in rows_of(again)] == [r[:2] for r in validation_rows],
            "logprob_gap_max": sampled_check["logprob_gap"],
            "engine_calls": greedy_check["calls"],
            "requests": len(validation_rows) * 2 + len(sampled_rows), "rows": len(sampled_rows)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face folder with a chat template (default: SmolLM2 in "
                             "the tlt_core cache)")
    parser.add_argument("--samples", type=int, default=2, help="GRPO samples per prompt")
    parser.add_argument("--response-length", type=int, default=16)
    args = parser.parse_args(argv)
    import ray

    from tlt_core.integrations.verl.registration import register
    from tlt_core.model.gguf_convert import SMOLLM2, cached_conversion

    register()  # "tlt" in veRL's registries, in this process (the worker registers its own)
    model = args.model or cached_conversion(SMOLLM2.path(), name=SMOLLM2.name)
    config = verl_config(model, args.samples, args.response_length)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = asyncio.run(run(config, args.samples))
    finally:
        ray.shutdown()
    print({key: value for key, value in result.items()})
    assert result["engine_calls"] < result["requests"], "concurrent requests were not batched"
    assert result["greedy_equal"], "greedy tokens differ from plain decoding"
    assert result["wake_equal"], "greedy tokens changed across sleep and wake"
    assert result["logprob_gap_max"] < TOLERANCE, result["logprob_gap_max"]
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
