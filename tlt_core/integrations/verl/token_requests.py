"""veRL's token-in / token-out requests, both ways: what its agent loop sends a rollout server
one request at a time (`generate(prompt_ids, sampling_params, request_id)`), read into the
engine's SamplingParams, and what goes back for each. Plain Python, no veRL import: server.py
wraps the result in veRL's TokenOutput.

The agent loop's sampling_params (veRL 0.9, `AgentLoopWorker.generate_sequences` and its
clients): temperature (0: greedy), top_p, top_k (-1: off), repetition_penalty, logprobs (return
log-probs: rollout.calculate_log_probs), and optionally max_tokens or max_new_tokens (a
response budget) and stop_token_ids (a tool agent's extra stops). Without a budget a request
gets min(response_length, prompt_length + response_length - its prompt length), as veRL's
own servers give it. Stops: the model's eos ids (none under rollout.ignore_eos) and
stop_token_ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tlt_core.engine.records import SamplingParams

BUDGET_KEYS = ("max_tokens", "max_new_tokens")
KNOWN_KEYS = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "logprobs",
                        "stop_token_ids", *BUDGET_KEYS})


@dataclass(frozen=True)
class TokenRequest:
    """One agent-loop request as the engine runs it; params has no seed (the rollout seeds
    each batch it runs)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    return_logprobs: bool


@dataclass(frozen=True)
class TokenResult:
    """One request's response: its tokens (the stop token included), each token's target
    log-probability under the distribution it was sampled from, and the version of the weights
    that generated it (veRL's global_steps of the last weight sync; None before one)."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (a stop id) or "length" (the budget)
    weights_step: int | None


def read_token_request(prompt_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       config: Any, model_stop_ids: Sequence[int]) -> TokenRequest:
    """The engine's request for one agent-loop call (module docstring); ValueError naming the
    argument or key it cannot honour. Neither argument is modified."""
    prompt = tuple(int(token) for token in prompt_ids)
    if not prompt:
        raise ValueError("prompt_ids: empty; a request needs at least one prompt token")
    unknown = sorted(set(sampling_params) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"sampling_params: unknown key(s) {unknown} for the tlt rollout; known: "
                         f"{sorted(KNOWN_KEYS)}")
    penalty = float(sampling_params.get("repetition_penalty", 1.0))
    if penalty != 1.0:
        raise ValueError(f"sampling_params: repetition_penalty must be 1 (the engine samples the "
                         f"model's distribution), got {penalty}")
    budget = next((sampling_params[key] for key in BUDGET_KEYS if key in sampling_params), None)
    if budget is None:
        budget = min(config.response_length,
                     config.prompt_length + config.response_length - len(prompt))
        if budget < 1:
            raise ValueError(f"prompt_ids: {len(prompt)} tokens leave no response budget "
                             f"(prompt_length + response_length = "
                             f"{config.prompt_length + config.response_length})")
    stop_ids = () if config.ignore_eos else tuple(int(t) for t in model_stop_ids)
    extra_stops = tuple(int(t) for t in sampling_params.get("stop_token_ids") or ())
    temperature = float(sampling_params.get("temperature", config.temperature))
    try:
        params = SamplingParams(temperature=temperature,
                                top_k=max(int(sampling_params.get("top_k", config.top_k)), 0),
                                top_p=float(sampling_params.get("top_p", config.top_p)),
                                max_tokens=int(budget),
                                stop_ids=stop_ids + tuple(t for t in extra_stops
                                                          if t not in stop_ids))
    except ValueError as error:
        raise ValueError(f"sampling_params: {error}") from error
    return TokenRequest(prompt, params, bool(sampling_params.get("logprobs", False)))
