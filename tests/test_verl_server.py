"""The tlt rollout as veRL's agent loop reaches it: the "tlt" server replica in veRL's
RolloutReplicaRegistry and the server it launches, driven as the agent loop drives it, with
concurrent `generate(prompt_ids, sampling_params, request_id)` calls. Invariants: concurrent
requests run as one engine call and each gets its own response; greedy tokens are the engine's
plain tokens; log-probs agree with the target's recomputation; sleep frees the engine and wake
brings the same outputs back; an aborted request comes back empty and marked aborted; a request
the server cannot honour gets an error naming the argument, and the others are served. The
slow tests run the replica on a local Ray cluster, its server actor reaching the rollout on a
worker actor as in veRL's hybrid mode: once driven directly, once by veRL's own agent loop
(examples/verl_agent_loop_tlt.py, with SmolLM2; it skips without veRL's agent-loop
dependencies cachetools, fastapi and uvicorn)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

pytest.importorskip("verl")

from verl.workers.config import HFModelConfig  # noqa: E402
from verl.workers.rollout.replica import (RolloutMode, RolloutReplica,  # noqa: E402
                                          RolloutReplicaRegistry, get_rollout_replica_class)

from tests import test_verl_backend as backend  # noqa: E402
from tests.test_verl_backend import PROMPTS, make_rollout, plain_greedy  # noqa: E402
from tlt_core.integrations.verl.server import (LocalRollout, TLTReplica,  # noqa: E402
                                               TLTTokenServer, call_worker_rollout)

GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
          "logprobs": True}  # what veRL's agent loop sends for a greedy request
SAMPLED = {**GREEDY, "temperature": 1.0}
folders = backend.folders  # the backend tests' fixture: a tiny target and its drafter


def make_server(folders, mode=RolloutMode.HYBRID, collect_s=0.005, **rollout_settings):
    rollout = make_rollout(folders, **rollout_settings)
    model_config = HFModelConfig(path=str(folders["target"]), load_tokenizer=False)
    server = TLTTokenServer(rollout.config, model_config, mode, LocalRollout(rollout),
                            collect_s=collect_s)
    return server, rollout


async def generate_all(server, prompts, sampling_params):
    return await asyncio.gather(*[server.generate(prompt, dict(sampling_params), f"r{i}")
                                  for i, prompt in enumerate(prompts)])


def target_logprobs(target, prompt, response) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([prompt + response])
        logits = target(ids, torch.arange(ids.shape[1])[None]).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1]
        return logprobs.gather(1, torch.tensor(response)[:, None])[:, 0]


def test_veRLs_replica_registry_returns_the_tlt_replica():
    assert RolloutReplicaRegistry.get("tlt") is TLTReplica
    assert get_rollout_replica_class("tlt") is TLTReplica
    assert issubclass(TLTReplica, RolloutReplica)


def test_concurrent_greedy_requests_run_as_one_call_with_the_engines_plain_tokens(folders):
    server, rollout = make_server(folders)
    asyncio.run(rollout.update_weights(backend.weight_stream(rollout.target), global_steps=4))
    outputs = asyncio.run(generate_all(server, PROMPTS, GREEDY))
    assert rollout.calls == 1  # the four requests were one engine call
    assert [o.token_ids for o in outputs] == plain_greedy(rollout.target)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.stop_reason == "completed" and output.extra_fields["global_steps"] == 4
        torch.testing.assert_close(torch.tensor(output.log_probs),
                                   target_logprobs(rollout.target, prompt, output.token_ids),
                                   atol=1e-4, rtol=0)
    without = asyncio.run(generate_all(server, PROMPTS[:1], {**GREEDY, "logprobs": False}))
    assert without[0].log_probs is None and rollout.calls == 2


def test_requests_that_trickle_in_are_collected_into_one_call(folders):
    server, rollout = make_server(folders, drafter=False, strategy="plain", collect_s=0.05)

    async def trickle():  # as the agent loop sends them: each after its own tokenization
        tasks = []
        for index, prompt in enumerate(PROMPTS):
            tasks.append(asyncio.create_task(server.generate(prompt, dict(GREEDY), str(index))))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks)

    outputs = asyncio.run(trickle())
    assert rollout.calls == 1
    assert [o.token_ids for o in outputs] == plain_greedy(rollout.target)


def test_a_groups_samples_differ_and_their_logprobs_equal_the_targets_recomputation(folders):
    server, rollout = make_server(folders, strategy="suffix(4)", drafter=False)
    prompts = [p for p in PROMPTS for _ in range(3)]  # the agent loop's n=3 per prompt
    outputs = asyncio.run(generate_all(server, prompts, SAMPLED))
    assert rollout.calls == 1
    assert len({tuple(o.token_ids) for o in outputs[:3]}) > 1
    for prompt, output in zip(prompts, outputs):
        assert 1 <= len(output.token_ids) <= rollout.config.response_length
        torch.testing.assert_close(torch.tensor(output.log_probs),
                                   target_logprobs(rollout.target, prompt, output.token_ids),
                                   atol=1e-4, rtol=0)


def test_a_budget_and_extra_stop_ids_are_honoured(folders):
    server, rollout = make_server(folders, drafter=False, strategy="plain")
    greedy = plain_greedy(rollout.target)
    short = asyncio.run(generate_all(server, PROMPTS[:1], {**GREEDY, "max_tokens": 2}))
    assert short[0].token_ids == greedy[0][:2]
    stop = greedy[0][1]
    stopped = asyncio.run(generate_all(server, PROMPTS[:1], {**GREEDY, "stop_token_ids": [stop]}))
    assert stopped[0].token_ids == greedy[0][:greedy[0].index(stop) + 1]


def test_sleep_frees_the_engine_and_wake_brings_the_same_outputs_back(folders):
    server, rollout = make_server(folders)
    before = asyncio.run(generate_all(server, PROMPTS, GREEDY))
    asyncio.run(server.sleep())
    assert rollout.engine is None
    with pytest.raises(RuntimeError, match="resume"):
        asyncio.run(generate_all(server, PROMPTS[:1], GREEDY))
    asyncio.run(server.wake_up())
    after = asyncio.run(generate_all(server, PROMPTS, GREEDY))
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    standalone, alone_rollout = make_server(folders, mode=RolloutMode.STANDALONE)
    asyncio.run(generate_all(standalone, PROMPTS[:1], GREEDY))
    asyncio.run(standalone.sleep())  # a standalone replica keeps its cache, as veRL's do
    assert alone_rollout.engine is not None


def test_abort_answers_waiting_requests_as_aborted_and_holds_new_ones_until_resume(folders):
    server, rollout = make_server(folders, drafter=False, strategy="plain", collect_s=0.2)

    async def scenario():
        waiting = asyncio.create_task(server.generate(PROMPTS[0], dict(GREEDY), "a"))
        await asyncio.sleep(0.01)  # queued, the server still collecting
        assert (await server.abort_all_requests())["aborted_count"] == 1
        aborted = await waiting
        held = asyncio.create_task(server.generate(PROMPTS[0], dict(GREEDY), "b"))
        await asyncio.sleep(0.3)
        assert not held.done()  # paused: held until resume_generation
        await server.resume_generation()
        return aborted, await held

    aborted, resumed = asyncio.run(scenario())
    assert aborted.stop_reason == "aborted" and aborted.token_ids == []
    assert resumed.stop_reason == "completed"
    assert resumed.token_ids == plain_greedy(rollout.target)[0]

    async def refused():
        await server.abort_all_requests(reject_request=True)
        await server.generate(PROMPTS[0], dict(GREEDY), "c")

    with pytest.raises(RuntimeError, match="paused"):
        asyncio.run(refused())


def test_a_request_the_server_cannot_honour_is_named_and_the_others_are_served(folders):
    server, rollout = make_server(folders, drafter=False, strategy="plain")

    async def mixed():
        return await asyncio.gather(
            server.generate(PROMPTS[0], dict(GREEDY), "good"),
            server.generate(PROMPTS[1], {**GREEDY, "repetition_penalty": 1.2}, "penalty"),
            server.generate(PROMPTS[1], {**GREEDY, "n": 2}, "unknown"),
            server.generate(PROMPTS[1], dict(GREEDY), "image", image_data=["x"]),
            server.generate([], dict(GREEDY), "empty"),
            return_exceptions=True)

    good, penalty, unknown, image, empty = asyncio.run(mixed())
    assert good.token_ids == plain_greedy(rollout.target)[0]
    for error, name in ((penalty, "repetition_penalty"), (unknown, "'n'"),
                        (image, "image_data"), (empty, "prompt_ids")):
        assert isinstance(error, ValueError) and name in str(error)
    too_long = list(range(1, rollout.config.prompt_length + rollout.config.response_length + 1))
    with pytest.raises(ValueError, match="prompt_ids"):
        asyncio.run(server.generate(too_long, dict(GREEDY), "long"))


def test_a_worker_call_reaches_the_rollout_where_veRLs_workers_hold_it(folders):
    rollout = make_rollout(folders, drafter=False, strategy="plain")
    for worker in (types.SimpleNamespace(rollout=rollout),  # the fused actor/rollout worker
                   types.SimpleNamespace(server_adapter=rollout)):  # a CheckpointEngineWorker
        call_worker_rollout(worker, "drop_engine")
        assert not rollout.awake
        call_worker_rollout(worker, "restore_engine", ["kv_cache"])
        assert rollout.awake
    with pytest.raises(TypeError, match="TLTVerlRollout"):
        call_worker_rollout(types.SimpleNamespace(rollout=object()), "drop_engine")


RAY_HYBRID_SCRIPT = """
import asyncio, types
import ray
from verl.workers.config import HFModelConfig
from verl.workers.rollout.replica import get_rollout_replica_class
from tests.test_verl_backend import PROMPTS, make_rollout, plain_greedy

FOLDERS = {folders!r}
GREEDY = {greedy!r}


@ray.remote
class FusedWorker:  # veRL's hybrid worker: it holds the rollout as .rollout
    def __init__(self):
        self.rollout = make_rollout(FOLDERS, drafter=False, strategy="plain")

    async def update_weights(self):  # an async method, as veRL's worker has: an async actor
        await self.rollout.resume(tags=["kv_cache"])

    def awake(self):
        return self.rollout.awake


async def main():
    worker = FusedWorker.remote()
    config = await worker.__ray_call__.remote(lambda w: w.rollout.config)
    replica = get_rollout_replica_class("tlt")(
        replica_rank=0, config=config,
        model_config=HFModelConfig(path=FOLDERS["target"], load_tokenizer=False),
        gpus_per_node=1)
    await replica.init_hybrid(types.SimpleNamespace(workers=[worker]))
    server = replica.server_handle
    outputs = await asyncio.gather(*[
        server.generate.remote(prompt_ids=p, sampling_params=dict(GREEDY), request_id=str(i))
        for i, p in enumerate(PROMPTS)])
    target = await worker.__ray_call__.remote(lambda w: w.rollout.target)
    assert [o.token_ids for o in outputs] == plain_greedy(target), outputs
    calls = await worker.__ray_call__.remote(lambda w: w.rollout.calls)
    assert calls == 1, calls
    await replica.sleep()
    assert not await worker.awake.remote()
    await worker.update_weights.remote()
    again = await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params=dict(GREEDY),
                                         request_id="again")
    assert again.token_ids == outputs[0].token_ids
    print("RAY HYBRID OK", replica.server_address)


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
try:
    asyncio.run(main())
finally:
    ray.shutdown()
"""


@pytest.mark.slow
def test_the_replica_on_a_local_ray_cluster_serves_from_the_workers_rollout(folders, tmp_path):
    script = tmp_path / "ray_hybrid.py"
    script.write_text(textwrap.dedent(RAY_HYBRID_SCRIPT).format(
        folders={"target": str(folders["target"]), "drafter": str(folders["drafter"])},
        greedy=GREEDY))
    root = str(pathlib.Path(__file__).resolve().parents[1])  # tests/ and tlt_core/, for Ray's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # worker processes too
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    assert done.returncode == 0 and "RAY HYBRID OK tlt_server_0" in done.stdout, (
        done.stdout[-3000:] + done.stderr[-3000:])


@pytest.mark.slow
def test_veRLs_own_agent_loop_generates_through_the_replica(smollm2_dir):
    for name in ("cachetools", "fastapi", "uvicorn"):  # veRL's agent-loop modules import them
        pytest.importorskip(name)
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "examples" / "verl_agent_loop_tlt.py"),
                           "--model", str(smollm2_dir), "--response-length", "8"],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "'greedy_equal': True" in done.stdout
