"""veRL's generation batch layout, both ways: the prompts and sampling parameters the engine
needs from the tensors and meta_info veRL hands a rollout, and the response tensors veRL's
trainer reads back. Plain torch, no veRL import: rollout.py wraps them in DataProto.

Shapes: B rows, P padded prompt width, R = response_length.

In (a DataProto's `batch` and `meta_info`, as veRL's trainer builds them for generation):
- input_ids (B, P) int: prompts, left-padded;
- attention_mask (B, P): 1 on a row's prompt tokens, which sit contiguous at the right end;
- position_ids (B, P): 0, 1, ... over a row's prompt tokens (what the engine's own positions
  are; a layout with other positions, such as Qwen2-VL's (B, 3, P), is refused);
- meta_info: do_sample (False: greedy), validate (sample with the config's val_kwargs),
  temperature, top_k (-1 or 0: off), top_p, response_length, eos_token_id (an int or a list),
  pad_token_id; each absent key falls back to the rollout config (eos and pad: the model's).

Out (veRL's rollout output; its trainer derives response_mask from attention_mask):
- prompts (B, P): input_ids as given;
- responses (B, R): each row's tokens, the stop token included, then pad_token_id;
- input_ids (B, P + R): prompts then responses;
- attention_mask (B, P + R): the prompt mask, then 1 on each response token;
- position_ids (B, P + R): the prompt's, continued by 1, 2, ... R from its last;
- rollout_log_probs (B, R) float32: the target's log-probability of each response token
  under the distribution it was sampled from, 0 past the response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

REQUIRED_FIELDS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class VerlSampling:
    """How one veRL batch is sampled: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float
    top_k: int
    top_p: float
    response_length: int
    stop_ids: tuple[int, ...]
    pad_token_id: int


@dataclass(frozen=True)
class PromptBatch:
    """The prompts of one veRL batch, unpadded, with the tensors the output extends."""

    prompt_ids: list[list[int]]  # B lists: each row's prompt tokens, padding removed
    input_ids: torch.Tensor  # (B, P) as given
    attention_mask: torch.Tensor  # (B, P) as given
    position_ids: torch.Tensor  # (B, P) as given


def read_prompts(batch: Mapping[str, torch.Tensor] | None) -> PromptBatch:
    """The prompts of veRL's `batch` tensors; ValueError naming the field that is missing or
    not in veRL's layout (nothing is modified)."""
    if batch is None:
        raise ValueError(f"batch: the DataProto has no tensors; a rollout needs "
                         f"{', '.join(REQUIRED_FIELDS)}")
    keys = set(batch.keys())
    missing = [name for name in REQUIRED_FIELDS if name not in keys]
    if missing:
        raise ValueError(f"batch: lacks {', '.join(missing)} (a rollout needs "
                         f"{', '.join(REQUIRED_FIELDS)}; it has {sorted(keys)})")
    input_ids, mask, positions = (batch[name] for name in REQUIRED_FIELDS)
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected (B, P) integer token ids, got "
                         f"{tuple(input_ids.shape)} {input_ids.dtype}")
    for name, tensor in (("attention_mask", mask), ("position_ids", positions)):
        if tuple(tensor.shape) != tuple(input_ids.shape):
            raise ValueError(f"{name}: expected input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(tensor.shape)}")
    keep = mask.bool()  # (B, P)
    width = input_ids.shape[1]
    lengths = keep.sum(1)  # (B,)
    prompt_ids = []
    for row in range(input_ids.shape[0]):
        length = int(lengths[row])
        if length == 0:
            raise ValueError(f"attention_mask: row {row} has no prompt token")
        if not bool(keep[row, width - length:].all()):
            raise ValueError(f"attention_mask: row {row} is not left-padded (its prompt tokens "
                             "must sit contiguous at the right end, as veRL pads prompts)")
        expected = torch.arange(length, device=positions.device)
        if not torch.equal(positions[row, width - length:].to(expected.dtype), expected):
            raise ValueError(f"position_ids: row {row} does not count 0, 1, ... over its "
                             "prompt tokens; the engine places prompts at those positions")
        prompt_ids.append(input_ids[row, width - length:].tolist())
    return PromptBatch(prompt_ids, input_ids, mask, positions)


def left_padded_prompts(prompt_ids: Sequence[Sequence[int]], pad_id: int
                        ) -> dict[str, torch.Tensor]:
    """Prompts as veRL's trainer hands them to a rollout (what read_prompts reads): left-padded
    `input_ids`, `attention_mask` and `position_ids` counting over each prompt."""
    if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
        raise ValueError("prompt_ids: need at least one prompt, each of at least one token")
    width = max(map(len, prompt_ids))
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(prompt_ids), width, dtype=torch.int64)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.int64)
        mask[row, width - len(ids):] = 1
    return {"input_ids": input_ids, "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}


def read_sampling(meta_info: Mapping[str, Any], config: Any,
                  default_stop_ids: Sequence[int], default_pad_id: int) -> VerlSampling:
    """The batch's sampling, as veRL's rollouts read it: meta_info over the rollout config
    (do_sample, temperature, top_k, top_p, response_length, val_kwargs when validating, and
    ignore_eos); eos / pad ids from meta_info, else the model's."""
    do_sample = bool(meta_info.get("do_sample", config.do_sample))
    if do_sample and meta_info.get("validate", False):
        val = config.val_kwargs
        do_sample = bool(val.do_sample)
        temperature, top_k, top_p = val.temperature, val.top_k, val.top_p
    else:
        temperature = meta_info.get("temperature", config.temperature)
        top_k = meta_info.get("top_k", config.top_k)
        top_p = meta_info.get("top_p", config.top_p)
    response_length = int(meta_info.get("response_length", config.response_length))
    if response_length < 1:
        raise ValueError(f"response_length: must be >= 1, got {response_length}")
    eos = meta_info.get("eos_token_id", None)
    stop_ids = (tuple(default_stop_ids) if eos is None else
                (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos))
    if config.ignore_eos:
        stop_ids = ()
    pad = meta_info.get("pad_token_id", None)
    return VerlSampling(temperature=float(temperature) if do_sample else 0.0,
                        top_k=max(int(top_k), 0),  # veRL's -1, like vLLM's, means off
                        top_p=float(top_p), response_length=response_length,
                        stop_ids=stop_ids, pad_token_id=default_pad_id if pad is None else int(pad))


def response_tensors(prompts: PromptBatch, responses: Sequence[torch.Tensor],
                     logprobs: Sequence[torch.Tensor], response_length: int,
                     pad_token_id: int) -> dict[str, torch.Tensor]:
    """veRL's output tensors (module docstring) for one response and its log-probs per row,
    each at most response_length long, in the batch's order, on the prompts' device."""
    input_ids, mask, positions = prompts.input_ids, prompts.attention_mask, prompts.position_ids
    B, R = input_ids.shape[0], response_length
    if len(responses) != B or len(logprobs) != B:
        raise ValueError(f"responses, logprobs: one per row ({B}), got {len(responses)} and "
                         f"{len(logprobs)}")
    device = input_ids.device
    tokens = torch.full((B, R), pad_token_id, dtype=input_ids.dtype, device=device)  # (B, R)
    token_logprobs = torch.zeros(B, R, dtype=torch.float32, device=device)  # (B, R)
    response_mask = torch.zeros(B, R, dtype=mask.dtype, device=device)  # (B, R)
    for row, (response, row_logprobs) in enumerate(zip(responses, logprobs)):
        length = len(response)
        if length > R:
            raise ValueError(f"responses: row {row} has {length} tokens, more than "
                             f"response_length ({R})")
        tokens[row, :length] = response.to(device)
        token_logprobs[row, :length] = row_logprobs.to(device)
        response_mask[row, :length] = 1
    steps = torch.arange(1, R + 1, dtype=positions.dtype, device=device)  # (R,)
    return {"prompts": input_ids,
            "responses": tokens,
            "input_ids": torch.cat([input_ids, tokens], 1),  # (B, P + R)
            "attention_mask": torch.cat([mask, response_mask], 1),  # (B, P + R)
            "position_ids": torch.cat([positions, positions[:, -1:] + steps], 1),  # (B, P + R)
            "rollout_log_probs": token_logprobs}
