"""`sample_draft`: a drafting level's sampled tokens in one kernel call on the CPU
(csrc/include/tlt/draft_sample.h): q = softmax(logits / T) over the drafter's V' tokens (one-hot
at the argmax for a greedy row), written over the target's V ids, and n tokens drawn from that
same q by inverse CDF with the given uniforms.

PyTorch spends about sixteen ops a level on it (tlt_core.drafting.sampled_chain.draw, the path
GPUs keep, where a captured graph replays them at no per-op cost). CPU tensors only.
"""

from __future__ import annotations

import torch

from tlt_core import _C
from tlt_core.ops._cpu_tensors import described

# row_status codes (csrc/include/tlt/common.h) -> what was wrong
_PROBLEMS = {1: ("logits", "has NaN or +inf, or only -inf, in a row"),
             6: ("uniforms", "has a value outside [0, 1)")}


def sample_draft(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor,
                 draft_to_target: torch.Tensor | None = None, vocab: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (M, V') float32, uniforms (M, n) float32 in [0, 1), temperature (M,) float32
    (<= 0: a greedy row), draft_to_target (V',) int64 distinct ids in [0, vocab) or None (V = V').
    Returns (ids (M, n) int64 target ids, q (M, V) float32: the distribution each row's ids were
    drawn from, over the target's ids). A bad row raises ValueError naming the argument."""
    for name, tensor, dims in (("logits", logits, 2), ("uniforms", uniforms, 2),
                               ("temperature", temperature, 1)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 torch tensor, got {described(tensor)}")
        if tensor.device.type != "cpu" or tensor.dim() != dims or tensor.layout != torch.strided:
            raise ValueError(f"{name}: expected a {dims}-D CPU tensor, got "
                             f"{described(tensor)}")
    rows, draft_vocab = logits.shape
    if draft_vocab < 1:
        raise ValueError("logits: needs a draft vocabulary V' >= 1")
    if uniforms.shape[0] != rows or uniforms.shape[1] < 1:
        raise ValueError(f"uniforms: expected ({rows}, n >= 1), got {tuple(uniforms.shape)}")
    if temperature.shape != (rows,):
        raise ValueError(f"temperature: expected ({rows},), got {tuple(temperature.shape)}")
    if draft_to_target is None:
        if vocab not in (None, draft_vocab):
            raise ValueError(f"vocab: without draft_to_target it is V' = {draft_vocab}, "
                             f"got {vocab!r}")
        vocab = draft_vocab
    else:
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < draft_vocab:
            raise ValueError(f"vocab: the target's V, an int >= V' = {draft_vocab}, got "
                             f"{vocab!r}")
        if (not isinstance(draft_to_target, torch.Tensor) or draft_to_target.dtype != torch.int64
                or draft_to_target.shape != (draft_vocab,)
                or draft_to_target.device.type != "cpu"):
            raise ValueError(f"draft_to_target: expected ({draft_vocab},) int64 CPU ids, got "
                             f"{described(draft_to_target)}")
        if draft_vocab and (int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= vocab
                            or int(draft_to_target.unique().numel()) != draft_vocab):
            raise ValueError(f"draft_to_target: ids must be distinct and in [0, {vocab})")
    ids, q, status = launch(logits.contiguous(), uniforms.contiguous(), temperature.contiguous(),
                            None if draft_to_target is None else draft_to_target.contiguous(),
                            vocab)
    bad = torch.nonzero(status).flatten()
    if bad.numel():
        row = int(bad[0])
        name, problem = _PROBLEMS.get(int(status[row]), ("logits", "was rejected"))
        raise ValueError(f"{name}: row {row} {problem}")
    return ids, q


def launch(logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor,
           draft_to_target: torch.Tensor | None, vocab: int, out: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sample_draft without its checks, for arguments already known good (a drafting level's
    own logits and uniforms, every tensor contiguous); out: (M, V) float32 rows of equal stride
    to write q into in place (the step's draft_probs), else a new tensor. Returns (ids, q,
    row_status (M,) int32) with the bad rows' ids -1 and q 0, unraised."""
    rows, draft_vocab = logits.shape
    draws = uniforms.shape[1]
    ids = torch.empty(rows, draws, dtype=torch.int64)
    q = torch.empty(rows, vocab, dtype=torch.float32) if out is None else out
    status = torch.empty(rows, dtype=torch.int32)
    _C.sample_draft(logits.data_ptr(), rows, draft_vocab, temperature.data_ptr(),
                    uniforms.data_ptr(), draws,
                    0 if draft_to_target is None else draft_to_target.data_ptr(), vocab,
                    q.data_ptr(), q.stride(0) if rows > 1 else vocab, ids.data_ptr(),
                    status.data_ptr())
    return ids, q, status
