"""The tlt rollout as veRL's agent loop reaches it: a server replica (`TLTReplica`, veRL's
RolloutReplica, registered as "tlt" in its RolloutReplicaRegistry by registration.py) and the
server it launches (`TLTTokenServer`).

veRL 0.9's PPO trainer generates through its agent loop: every sample is an async task that
sends `generate(prompt_ids, sampling_params, request_id)` to a replica's server and awaits a
TokenOutput (token_requests.py reads the request). The engine generates batches, so the server
queues requests and, whenever no engine call is running, collects the agent loop's concurrent
requests (until none has arrived for COLLECT_S, at most MAX_COLLECT_S: the agent loop
tokenizes each sample before sending it, so a batch's requests trickle in) and runs every
request waiting as one engine call (the engine admits rows as others finish, up to
engine_kwargs.tlt.max_batch). Requests arriving during a call wait for the next one.

The model is not in the server. It stays in the TLTVerlRollout that veRL's worker builds, where
veRL's weight sync already reaches it: the fused actor/rollout worker's `.rollout` in hybrid
mode, the CheckpointEngineWorker's `.server_adapter` in colocated and standalone modes. The
server runs each batch there (WorkerRollout, through the worker actor's `__ray_call__`), which
is why a replica is one worker: tensor, pipeline and data parallel sizes are 1. LocalRollout
runs the batches on a rollout in the server's own process instead.

Sleep and wake follow veRL's servers: with rollout.free_cache_engine, `sleep()` frees the
engine's KV cache once the calls in flight finish (the trainer calls it after generation, in
hybrid mode; the worker's update_weights wakes it), `wake_up()` rebuilds it; a standalone
replica, on its own devices, does neither. `abort_all_requests()` (veRL's partial rollout)
answers each request not yet running as aborted (no tokens; veRL's client resends it) and
holds or, with reject_request, refuses new ones until `resume_generation()`; an engine call
already running completes.

Not served: multimodal inputs (image, video, audio), an OpenAI-compatible HTTP endpoint (the
replica's server_address is its server actor's name, a key for veRL's load balancer),
profiling, and prefill/decode disaggregation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from tlt_core.integrations.verl.rollout import KV_CACHE, TLTVerlRollout, model_token_ids
from tlt_core.integrations.verl.token_requests import (TokenRequest, TokenResult,
                                                       read_token_request)

COLLECT_S = 0.01  # a pause in arrivals this long ends a batch's collection
MAX_COLLECT_S = 0.25  # the longest a collection waits for more requests
COMPLETED, ABORTED = "completed", "aborted"  # TokenOutput.stop_reason, as veRL's servers say


class LocalRollout:
    """The server's batches on a TLTVerlRollout in this process, each in a thread so the
    server keeps taking requests meanwhile."""

    def __init__(self, rollout: TLTVerlRollout):
        self.rollout = rollout

    async def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        return await asyncio.to_thread(self.rollout.generate_token_requests, requests)

    async def release(self) -> None:
        self.rollout.drop_engine()

    async def resume(self, tags: Sequence[str]) -> None:
        self.rollout.restore_engine(tags)


class WorkerRollout:
    """The server's batches on the TLTVerlRollout a veRL worker actor holds (module
    docstring). The worker runs each call to the end before its next one: in hybrid mode it is
    idle while the agent loop generates."""

    def __init__(self, worker: ray.actor.ActorHandle):
        self.worker = worker

    async def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        return await self.worker.__ray_call__.remote(call_worker_rollout,
                                                     "generate_token_requests", list(requests))

    async def release(self) -> None:
        await self.worker.__ray_call__.remote(call_worker_rollout, "drop_engine")

    async def resume(self, tags: Sequence[str]) -> None:
        await self.worker.__ray_call__.remote(call_worker_rollout, "restore_engine", list(tags))


def call_worker_rollout(worker: Any, method: str, *args: Any) -> Any:
    """Runs on a veRL worker: `method(*args)` of the TLTVerlRollout it holds (`.rollout` of
    the fused worker, `.server_adapter` of a CheckpointEngineWorker)."""
    for attribute in ("rollout", "server_adapter"):
        rollout = getattr(worker, attribute, None)
        if isinstance(rollout, TLTVerlRollout):
            return getattr(rollout, method)(*args)
    raise TypeError(f"worker: {type(worker).__name__} holds no TLTVerlRollout in .rollout or "
                    ".server_adapter; is actor_rollout_ref.rollout.name 'tlt'?")


@dataclass
class _Waiting:
    request: TokenRequest
    result: asyncio.Future  # a TokenResult, or None when aborted


class TLTTokenServer:
    """veRL's token-in / token-out server over a tlt rollout (module docstring). veRL's replica
    runs it as a Ray actor; it is a plain class, so a test can drive it in-process."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: RolloutMode,
                 rollout: LocalRollout | WorkerRollout, collect_s: float = COLLECT_S,
                 max_collect_s: float = MAX_COLLECT_S):
        self.config: RolloutConfig = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.stop_ids, _ = model_token_ids(model_config)
        self.rollout_mode = rollout_mode
        self.rollout = rollout
        self.collect_s, self.max_collect_s = collect_s, max_collect_s
        self.waiting: list[_Waiting] = []
        self.batches: asyncio.Task | None = None  # the loop running engine calls, while any wait
        self.accepting = asyncio.Event()  # cleared by abort_all_requests
        self.accepting.set()
        self.reject_while_paused = False

    async def generate(self, prompt_ids: Sequence[int], sampling_params: dict[str, Any],
                       request_id: str, image_data: Any = None, video_data: Any = None,
                       audio_data: Any = None, mm_processor_kwargs: Any = None) -> TokenOutput:
        """One agent-loop request's response tokens and, when sampling_params asks for
        logprobs, their log-probabilities. mm_processor_kwargs only configures how media are
        processed, so without media it changes nothing."""
        given = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data}
        multimodal = sorted(name for name, value in given.items() if value is not None)
        if multimodal:
            raise ValueError(f"{', '.join(multimodal)}: the tlt rollout generates from token "
                             f"ids only (request {request_id})")
        request = read_token_request(prompt_ids, sampling_params, self.config, self.stop_ids)
        if not self.accepting.is_set():
            if self.reject_while_paused:
                raise RuntimeError(f"generate: request {request_id} refused: generation is "
                                   "paused (abort_all_requests(reject_request=True))")
            await self.accepting.wait()
        waiting = _Waiting(request, asyncio.get_running_loop().create_future())
        self.waiting.append(waiting)
        if self.batches is None or self.batches.done():
            self.batches = asyncio.create_task(self._run_batches())
        result: TokenResult | None = await waiting.result
        if result is None:
            return TokenOutput(token_ids=[], log_probs=[] if request.return_logprobs else None,
                               stop_reason=ABORTED, extra_fields={"global_steps": None})
        return TokenOutput(token_ids=result.token_ids,
                           log_probs=result.log_probs if request.return_logprobs else None,
                           stop_reason=COMPLETED,
                           extra_fields={"global_steps": result.weights_step})

    async def _run_batches(self) -> None:
        """Engine calls over what is waiting, until nothing is; each call's failure goes to
        its own requests."""
        while self.waiting:
            await self._collect()
            batch = [w for w in self.waiting if not w.result.done()]  # done: aborted
            self.waiting = []
            if not batch:
                continue
            try:
                results = await self.rollout.generate([w.request for w in batch])
            except Exception as error:  # noqa: BLE001 - the requests' callers receive it
                for waiting in batch:
                    if not waiting.result.done():
                        waiting.result.set_exception(error)
                continue
            for waiting, result in zip(batch, results):
                if not waiting.result.done():  # the caller may have given up
                    waiting.result.set_result(result)

    async def _collect(self) -> None:
        """Returns once no request has arrived for collect_s, or after max_collect_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_collect_s
        seen = -1
        while len(self.waiting) != seen and loop.time() < deadline:
            seen = len(self.waiting)
            await asyncio.sleep(min(self.collect_s, max(deadline - loop.time(), 0.0)))

    async def _drain(self) -> None:
        """Returns once no engine call is running or waiting to run."""
        while self.batches is not None and not self.batches.done():
            await self.batches

    # ---- veRL's control calls (RolloutReplica forwards them to its servers) -----------------

    async def sleep(self) -> None:
        if not self.config.free_cache_engine or self.rollout_mode == RolloutMode.STANDALONE:
            return
        await self._drain()
        await self.rollout.release()

    async def wake_up(self) -> None:
        if self.rollout_mode == RolloutMode.STANDALONE:
            return
        await self.rollout.resume([KV_CACHE])

    async def release_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self._drain()
            await self.rollout.release()

    async def resume_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self.rollout.resume([KV_CACHE])

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        self.accepting.clear()
        self.reject_while_paused = reject_request
        aborted = [w for w in self.waiting if not w.result.done()]
        for waiting in aborted:
            waiting.result.set_result(None)
        await self._drain()
        return {"aborted_count": len(aborted)}

    async def resume_generation(self) -> None:
        self.reject_while_paused = False
        self.accepting.set()


class TLTReplica(RolloutReplica):
    """veRL's rollout replica for name "tlt": one TLTTokenServer actor on the node of the one
    worker that holds the replica's TLTVerlRollout (module docstring)."""

    async def launch_servers(self) -> None:
        if self.world_size != 1 or len(self.workers) != 1:
            raise ValueError(f"rollout: a tlt replica is one worker (tensor, pipeline and data "
                             f"parallel sizes 1), got world size {self.world_size} and "
                             f"{len(self.workers)} worker(s)")
        worker = self.workers[0]
        node_id = await worker.__ray_call__.remote(
            lambda _: ray.get_runtime_context().get_node_id())
        role = "_reward" if self.is_reward_model else "_teacher" if self.is_teacher_model else ""
        name = f"tlt_server{role}_{self.replica_rank}{self.name_suffix}"
        server = ray.remote(TLTTokenServer).options(
            name=name, max_concurrency=self.max_concurrency,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(config=self.config, model_config=self.model_config,
                 rollout_mode=self.rollout_mode, rollout=WorkerRollout(worker))
        self.servers = [server]
        self._server_handle = server
        self._server_address = name
