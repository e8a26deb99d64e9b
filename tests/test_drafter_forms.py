"""The drafter's two forms ("tlt": pre-norm features, the layer's own input norm, final norm
before the head; "eagle": EAGLE-1 as serving engines run it). For each: the head applied to the
regression target gives the target's own logits, the packed inference path equals the autograd
path, training lowers the loss, and speculative rollout stays lossless."""

import json

import pytest
import torch

from tlt_core.drafting.drafter import DRAFTER_CONFIG_FILE, Drafter, DrafterConfig
from tlt_core.drafting.training import collect_records, eagle_loss, make_batch
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.workers.harvest import HarvestBuffer
from tlt_core.drafting.tree import Strategy
from tlt_core.workers.spot_trainer import SpotConfig, SpotTrainer

from tests.speculative_fixtures import (PROMPTS, VOCAB, tiny_target,
                                        tiny_target_with_a_final_norm, train_drafter)

FORMS = ("tlt", "eagle")


@pytest.fixture(scope="module")
def target():
    return tiny_target_with_a_final_norm()


@pytest.fixture(scope="module")
def eagle_drafter(target):
    torch.manual_seed(3)
    return train_drafter(target, form="eagle")


def test_form_is_validated_and_named():
    assert DrafterConfig().form == "eagle"  # the last layer alone: exportable
    assert DrafterConfig((0, -1)).form == "tlt"  # EAGLE-3 style fusion
    with pytest.raises(ValueError, match="form"):
        DrafterConfig(form="medusa")
    with pytest.raises(ValueError, match="feature_layers"):
        DrafterConfig((0, -1), form="eagle")  # EAGLE-1 reads the last layer only


@pytest.mark.parametrize("form", FORMS)
def test_head_on_the_regression_target_gives_the_target_logits(target, form):
    """logits(feature_target(h)) is exactly the target's logits at h: the drafter regresses onto
    what its head turns into the target's distribution. For form eagle, features(h) is also
    exactly that target (EAGLE-1 feeds the normed hidden state back as its feature)."""
    drafter = Drafter(target, DrafterConfig(form=form)).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        out = target(ids, torch.arange(ids.shape[1])[None], hidden_layers=[-1])
        last = out.hidden_states[0]  # (1, T, H), before the final norm
        assert torch.equal(drafter.logits(drafter.feature_target(last)), out.logits)
        if form == "eagle":
            assert torch.equal(drafter.features([last]), drafter.feature_target(last))
            assert isinstance(drafter.layer.input_layernorm, torch.nn.Identity)
            assert not any("input_layernorm" in name for name in drafter.state_dict())
        else:
            assert torch.equal(drafter.features([last]), last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", FORMS)
def test_packed_inference_equals_the_autograd_path(form, dtype):
    """With a cache at inference the drafter runs its packed layer (tlt_core.model.packed): a ragged
    prefix prefilled row by row, then the next tokens of all rows in one call, must give what
    the autograd module computes over each whole row without a cache. float32 folds the norms'
    weights into the matmuls, bfloat16 keeps the norms; form eagle has no input norm at all."""
    target = tiny_target().to(dtype)
    torch.manual_seed(5)
    drafter = Drafter(target, DrafterConfig(form=form)).eval()
    with torch.no_grad():  # non-trivial norm weights, so folding them wrongly shows
        for norm in (drafter.layer.post_attention_layernorm, drafter.layer.input_layernorm):
            if not isinstance(norm, torch.nn.Identity):
                norm.weight.uniform_(0.5, 1.5)
    prefixes, T, H = [1, 3, 6], 4, target.config.hidden_size
    B, width = len(prefixes), max(prefixes) + T
    tokens = torch.randint(0, VOCAB, (B, width))
    features = drafter.features([torch.randn(B, width, H, dtype=dtype)])  # (B, width, H)
    cache = drafter.new_cache(B, 16)
    with torch.no_grad():
        for b, n in enumerate(prefixes):
            row = cache.rows(b, 1)
            drafter(tokens[b:b + 1, :n], features[b:b + 1, :n], torch.arange(n)[None], row)
            row.commit(torch.tensor([n]))
        lengths = cache.lengths.clone()
        columns = lengths[:, None] + torch.arange(T)  # (B, T): each row's next T positions
        rows = torch.arange(B)[:, None]
        packed = drafter(tokens[rows, columns], features[rows, columns], columns, cache)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for b, n in enumerate(prefixes):
        with torch.enable_grad():  # the module itself: no cache, causal over the whole row
            whole = drafter(tokens[b:b + 1, :n + T], features[b:b + 1, :n + T],
                            torch.arange(n + T)[None])
        assert (packed[b].float() - whole[0, n:].detach().float()).abs().max() < tolerance


def test_eagle_form_trains(target):
    """The EAGLE loss falls for a form-eagle drafter, its regression term onto the normed
    hidden state, and the teacher-forced top-1 agreement rises above chance."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (4,), generator=g).tolist() for _ in range(32)]
    engine = RolloutEngine(target, EngineConfig(max_batch=32, max_len=40))
    rollouts = engine.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=24))
                                for p in prompts]).rollouts
    records = collect_records(target, [list(r.prompt_ids) + r.tokens.tolist() for r in rollouts],
                              (-1,))
    batch = make_batch(records)
    torch.manual_seed(0)
    drafter = Drafter(target, DrafterConfig(form="eagle"))
    with torch.no_grad():
        before, _ = eagle_loss(drafter, batch)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(40):
        loss, _ = eagle_loss(drafter, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after, metrics = eagle_loss(drafter, batch)
    assert float(after) < 0.5 * float(before)
    assert metrics["top1"] > 0.5


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_plain_with_an_eagle_drafter(target, eagle_drafter, batch):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = [Request(p, params) for p in PROMPTS]
    engine = RolloutEngine(target, EngineConfig(max_batch=batch, max_len=48), eagle_drafter)
    plain = engine.generate(requests)
    for strategy in (Strategy(4, 1, 4), Strategy(5, 4, 16), Strategy(6, 8, 32)):
        spec = engine.generate(requests, strategy=strategy)
        for a, b in zip(plain.rollouts, spec.rollouts, strict=True):
            assert b.tokens.tolist() == a.tokens.tolist(), strategy
            assert torch.allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
        assert spec.acceptance_length > 1.5, (strategy, spec.acceptance_length)


def test_eagle_drafter_spot_trains_on_harvested_data(target):
    """Harvest (raw target features) -> spot trainer -> a form-eagle drafter: the loss falls;
    the harvest needs nothing form-specific."""
    torch.manual_seed(0)
    drafter = Drafter(target, DrafterConfig(form="eagle")).eval()
    harvest = HarvestBuffer()
    engine = RolloutEngine(target, EngineConfig(max_batch=8, max_len=48), drafter, harvest)
    engine.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=30)) for p in PROMPTS],
                    strategy=Strategy(3, 2, 5))
    trainer = SpotTrainer(drafter, harvest, SpotConfig(lr=3e-3, batch_tokens=256))
    first = trainer.train_until(lambda: False, max_steps=1)
    later = trainer.train_until(lambda: False, max_steps=40)
    assert later.last_loss < first.last_loss


def test_form_survives_save_and_load_and_old_folders_load_as_tlt(target, eagle_drafter, tmp_path):
    eagle_drafter.save(tmp_path / "eagle")
    again = Drafter.load(tmp_path / "eagle", target)
    assert again.config == eagle_drafter.config
    for name, tensor in eagle_drafter.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor)

    Drafter(target, DrafterConfig(form="tlt")).save(tmp_path / "old")  # pre-forms: no "form" key
    config_path = tmp_path / "old" / DRAFTER_CONFIG_FILE
    record = json.loads(config_path.read_text())
    del record["drafter"]["form"]
    config_path.write_text(json.dumps(record))
    assert Drafter.load(tmp_path / "old", target).config.form == "tlt"
