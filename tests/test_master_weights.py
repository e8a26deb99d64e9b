"""MasterWeightAdamW: float32 policies get plain AdamW + clip_grad_norm_, bit for bit; bf16
policies keep float32 masters that accumulate updates bf16 would round away, and their weights
are always the masters rounded to bf16; a checkpoint resumes identically and refuses the other
precision's."""

import copy

import pytest
import torch

from tests.speculative_fixtures import VOCAB, tiny_target
from tlt_core.optim.master_weights import MasterWeightAdamW
from tlt_core.persistence.checkpoint_io import read_state, write_state

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
MAX_GRAD_NORM = 0.5


def batches(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (3, 9), generator=g) for _ in range(count)]


def backward(model, ids: torch.Tensor) -> None:
    """Next-token cross-entropy of ids (B, L) under model, backpropagated."""
    B, L = ids.shape
    logits = model(ids, torch.arange(L).expand(B, L)).logits.float()  # (B, L, V)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                      ids[:, 1:].reshape(-1)).backward()


def train(model, optimizer: MasterWeightAdamW, ids_list) -> list[float]:
    norms = []
    for ids in ids_list:
        optimizer.zero_grad()
        backward(model, ids)
        norms.append(optimizer.clip_and_step(MAX_GRAD_NORM))
    return norms


def test_float32_is_plain_adamw_bit_for_bit():
    ours_model = tiny_target()
    torch_model = copy.deepcopy(ours_model)
    ours = MasterWeightAdamW(ours_model.parameters(), **ADAMW)
    assert not ours.mixed and ours.masters is ours.parameters  # no copies in float32
    theirs = torch.optim.AdamW(torch_model.parameters(), **ADAMW)
    clipped = 0
    for ids in batches(4):
        ours.zero_grad()
        backward(ours_model, ids)
        norm = ours.clip_and_step(MAX_GRAD_NORM)
        theirs.zero_grad()
        backward(torch_model, ids)
        expected = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), MAX_GRAD_NORM)
        theirs.step()
        assert norm == float(expected)
        clipped += norm > MAX_GRAD_NORM
        for (name, mine), reference in zip(ours_model.named_parameters(),
                                           torch_model.parameters()):
            assert torch.equal(mine, reference), name
    assert clipped  # the clipping path ran, not only the plain step


def test_bf16_masters_keep_updates_that_bf16_rounds_away():
    """Constant gradients g = +-1: every AdamW step moves a weight by lr * m_hat / (sqrt(v_hat)
    + eps) = lr / (1 + eps) towards zero. lr = 1e-4 is below half the bf16 spacing at every
    weight here (the least, 2^-11, is just below 0.25), so plain bf16 AdamW never moves them;
    the masters move by STEPS * lr = 0.01, which bf16 then shows."""
    start = [1.0, -0.5, 0.25, -2.0]
    grad = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.bfloat16)
    lr, steps = 1e-4, 100
    ours_weight = torch.nn.Parameter(torch.tensor(start, dtype=torch.bfloat16))
    plain_weight = torch.nn.Parameter(torch.tensor(start, dtype=torch.bfloat16))
    ours = MasterWeightAdamW([ours_weight], lr=lr, weight_decay=0.0)
    plain = torch.optim.AdamW([plain_weight], lr=lr, weight_decay=0.0)
    assert ours.mixed and ours.masters[0].dtype == torch.float32
    for _ in range(steps):
        ours.zero_grad()
        ours_weight.grad = grad.clone()
        ours.clip_and_step(max_grad_norm=1e9)  # never clips
        plain_weight.grad = grad.clone()
        plain.step()
        assert torch.equal(ours_weight, ours.masters[0].to(torch.bfloat16))
    assert plain_weight.tolist() == start
    expected = torch.tensor(start) - steps * lr * grad.float()  # 0.99, -0.49, 0.24, -1.99
    torch.testing.assert_close(ours.masters[0].detach(), expected, rtol=0, atol=1e-5)
    # 0.99 -> 0.98828125, -0.49 -> -0.490234375, 0.24 -> 0.240234375, -1.99 -> -1.9921875
    assert ours_weight.tolist() == [0.98828125, -0.490234375, 0.240234375, -1.9921875]


def test_bf16_weights_are_the_masters_rounded_at_every_step():
    model = tiny_target().to(torch.bfloat16)
    start = {name: p.detach().float() for name, p in model.named_parameters()}
    optimizer = MasterWeightAdamW(model.parameters(), **ADAMW)
    assert [m.dtype for m in optimizer.masters] == [torch.float32] * len(optimizer.masters)
    for p, m in zip(optimizer.parameters, optimizer.masters):
        assert torch.equal(m, p.float())  # masters start exactly at the weights
    for ids in batches(3):
        train(model, optimizer, [ids])
        for p, m in zip(optimizer.parameters, optimizer.masters):
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    moved = [name for name, p in model.named_parameters() if not torch.equal(p.float(),
                                                                             start[name])]
    assert len(moved) == len(start)  # every weight trained, so the equality above had work


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trip_resumes_identically(tmp_path, dtype):
    """2 steps, a checkpoint (through checkpoint_io, as the driver writes it), 2 more steps =
    a fresh model and optimizer that load it and take the same 2 steps."""
    ids_list = batches(4)
    model = tiny_target().to(dtype)
    optimizer = MasterWeightAdamW(model.parameters(), **ADAMW)
    train(model, optimizer, ids_list[:2])
    write_state({"policy": model.state_dict(), "optimizer": optimizer.state_dict()},
                tmp_path / "ckpt")
    norms = train(model, optimizer, ids_list[2:])

    resumed_model = tiny_target(seed=1).to(dtype)  # other weights: the checkpoint must set all
    resumed = MasterWeightAdamW(resumed_model.parameters(), **ADAMW)
    state = read_state(tmp_path / "ckpt")
    resumed_model.load_state_dict(state["policy"])
    resumed.load_state_dict(state["optimizer"])
    assert train(resumed_model, resumed, ids_list[2:]) == norms
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    for m, n in zip(optimizer.masters, resumed.masters):
        assert m.dtype == torch.float32 and torch.equal(m, n)


def test_a_mixed_checkpoint_does_not_load_into_a_float32_optimizer():
    mixed = MasterWeightAdamW(tiny_target().to(torch.bfloat16).parameters(), **ADAMW)
    plain = MasterWeightAdamW(tiny_target().parameters(), **ADAMW)
    with pytest.raises(ValueError, match="^optimizer: .*mixed precision, this policy is float32"):
        plain.load_state_dict(mixed.state_dict())
    with pytest.raises(ValueError, match="^optimizer: .*float32 precision, this policy is mixed"):
        mixed.load_state_dict(plain.state_dict())
