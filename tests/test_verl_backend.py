"""The tlt rollout backend for veRL, driven through veRL's own interfaces: its registry picks the
class by name, its config dataclasses build it, DataProto goes in and comes out, weights stream
in as veRL's workers send them, and release / resume are veRL's sleep and wake. Invariants:
greedy tokens are the engine's plain tokens (speculation on), log-probs agree with the target's
recomputation, the output has veRL's layout, weight sync changes what is generated, sleep / wake
keeps it, and a batch without the fields a rollout needs gets an error naming the field."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.utils.torch_functional import get_response_mask  # noqa: E402
from verl.workers.config import HFModelConfig, RolloutConfig, SamplingConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402

from tests.speculative_fixtures import tiny_target, train_drafter  # noqa: E402
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams  # noqa: E402
from tlt_core.integrations.verl import left_padded_prompts, registration  # noqa: E402
from tlt_core.integrations.verl.rollout import TLTVerlRollout  # noqa: E402
from tlt_core.model.checkpoint import save_checkpoint  # noqa: E402

EOS, PAD = 39, 0
RESPONSE_LENGTH = 10
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [4], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target's checkpoint (with its eos / pad ids, as veRL reads them), a second
    target's weights of the same shape, and the first one's trained drafter."""
    root = tmp_path_factory.mktemp("verl")
    target = tiny_target()
    save_checkpoint(target, root / "target",
                    extra_config={"eos_token_id": EOS, "pad_token_id": PAD})
    train_drafter(target, steps=30).save(root / "drafter")  # enough to accept drafts
    return {"target": root / "target", "drafter": root / "drafter",
            "other": tiny_target(seed=1)}


def make_rollout(folders, *, drafter=True, strategy="(3,1,4)", **config) -> TLTVerlRollout:
    """The rollout as veRL's worker builds it: class by name from the registry, then
    cls(config=RolloutConfig, model_config=HFModelConfig, device_mesh=...)."""
    tlt = {"strategy": strategy, "device": "cpu"}
    if drafter:
        tlt["drafter"] = str(folders["drafter"])
    fields = dict(name=registration.ROLLOUT_NAME, tensor_model_parallel_size=1, dtype="float32",
                  response_length=RESPONSE_LENGTH, prompt_length=8, seed=7,
                  engine_kwargs={"tlt": tlt})
    fields.update(config)
    cls = get_rollout_class(registration.ROLLOUT_NAME, registration.ROLLOUT_MODE)
    return cls(config=RolloutConfig(**fields),
               model_config=HFModelConfig(path=str(folders["target"]), load_tokenizer=False),
               device_mesh=None)


def verl_batch(prompts=PROMPTS, **meta_info) -> DataProto:
    """Prompts as veRL's trainer hands them to a rollout: left-padded, position ids counting
    over each prompt, sampling options in meta_info."""
    return DataProto.from_dict(left_padded_prompts(prompts, PAD),
                               non_tensors={"uid": [f"p{i}" for i in range(len(prompts))]},
                               meta_info={"eos_token_id": EOS, "pad_token_id": PAD,
                                          **meta_info})


def responses_of(output: DataProto) -> list[list[int]]:
    """Each row's response tokens, where the attention mask marks them."""
    mask = output.batch["attention_mask"][:, -RESPONSE_LENGTH:].bool()
    return [row[keep].tolist() for row, keep in zip(output.batch["responses"], mask)]


def plain_greedy(target, prompts=PROMPTS) -> list[list[int]]:
    engine = RolloutEngine(target, EngineConfig(max_batch=len(prompts), max_len=32))
    params = SamplingParams(temperature=0.0, max_tokens=RESPONSE_LENGTH, stop_ids=(EOS,))
    return [r.tokens.tolist() for r in engine.generate([Request(p, params) for p in prompts],
                                                       None).rollouts]


def test_verl_registry_selects_the_tlt_rollout_by_name():
    assert get_rollout_class("tlt", "async") is TLTVerlRollout
    registration.register()  # idempotent
    assert get_rollout_class("tlt", "async") is TLTVerlRollout


def test_greedy_speculative_tokens_equal_the_engines_plain_tokens(folders):
    rollout = make_rollout(folders)
    output = rollout.generate_sequences(verl_batch(do_sample=False))
    assert responses_of(output) == plain_greedy(rollout.target)
    metrics = output.meta_info["metrics"]
    assert metrics["spec/sd_step_share"] == 1.0  # every step was speculative: (3,1,4)
    assert metrics["spec/acceptance_length"] > 1.0  # the trained drafter's tokens were kept
    assert metrics["rollout/response_length_mean"] == pytest.approx(
        sum(map(len, responses_of(output))) / len(PROMPTS))


def test_output_has_verls_layout_and_keeps_the_input(folders):
    batch = verl_batch(do_sample=False, global_steps=3)
    output = make_rollout(folders).generate_sequences(batch)
    B, P, R = len(PROMPTS), batch.batch["input_ids"].shape[1], RESPONSE_LENGTH
    tensors = output.batch
    assert tensors["responses"].shape == (B, R) and tensors["rollout_log_probs"].shape == (B, R)
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert tensors[name].shape == (B, P + R)
    assert torch.equal(tensors["prompts"], batch.batch["input_ids"])
    assert torch.equal(tensors["input_ids"], torch.cat([batch.batch["input_ids"],
                                                        tensors["responses"]], 1))
    # veRL's own response mask (first eos included, nothing after) is the one we return
    assert torch.equal(tensors["attention_mask"][:, P:],
                       get_response_mask(tensors["responses"], EOS, torch.int64))
    assert torch.equal(tensors["attention_mask"][:, :P], batch.batch["attention_mask"])
    last = batch.batch["position_ids"][:, -1:]
    assert torch.equal(tensors["position_ids"][:, P:], last + torch.arange(1, R + 1))
    padding = ~tensors["attention_mask"][:, P:].bool()
    assert (tensors["responses"][padding] == PAD).all()
    assert (tensors["rollout_log_probs"][padding] == 0).all()
    assert list(output.non_tensor_batch["uid"]) == ["p0", "p1", "p2", "p3"]
    assert output.meta_info["global_steps"] == 3 and "metrics" in output.meta_info


def test_logprobs_equal_the_targets_recomputation_on_grouped_samples(folders):
    rollout = make_rollout(folders, strategy="suffix(4)", drafter=False)
    batch = verl_batch(do_sample=True, temperature=1.0).repeat(3, interleave=True)  # groups
    output = rollout.generate_sequences(batch)
    assert torch.equal(output.batch["prompts"], batch.batch["input_ids"])  # order kept
    responses = responses_of(output)
    assert len({tuple(r) for r in responses[:3]}) > 1  # a group's samples differ
    prompts = [p for p in PROMPTS for _ in range(3)]
    with torch.no_grad():
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([prompt + response])
            logits = rollout.target(ids, torch.arange(ids.shape[1])[None]).logits[0]
            logprobs = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1]
            expected = logprobs.gather(1, torch.tensor(response)[:, None])[:, 0]
            got = output.batch["rollout_log_probs"][row, :len(response)]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def weight_stream(model):
    """The actor's weights as veRL's workers send them: (name, tensor) in HF naming, one at a
    time, each a fresh copy (a sender may reuse its buffer after the copy)."""
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight" or not model.config.tie_word_embeddings:
            yield name, tensor.detach().clone()


def test_weight_sync_changes_outputs_to_the_new_weights(folders):
    rollout = make_rollout(folders)
    before = responses_of(rollout.generate_sequences(verl_batch(do_sample=False)))
    asyncio.run(rollout.update_weights(weight_stream(folders["other"]), global_steps=1))
    after = responses_of(rollout.generate_sequences(verl_batch(do_sample=False)))
    assert after == plain_greedy(folders["other"]) != before
    assert rollout.weights_step == 1


def test_weight_sync_refuses_other_shapes_and_lora_naming_them(folders):
    rollout = make_rollout(folders, drafter=False, strategy="plain")
    wrong = [("model.embed_tokens.weight", torch.zeros(3, 3))]
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        asyncio.run(rollout.update_weights(iter(wrong)))
    with pytest.raises(ValueError, match="lacks"):
        asyncio.run(rollout.update_weights(iter([])))
    with pytest.raises(ValueError, match="peft_config"):
        asyncio.run(rollout.update_weights(iter([]), peft_config={"r": 8}))
    with pytest.raises(ValueError, match="wire_format"):
        asyncio.run(rollout.update_weights(iter([]), wire_format="delta_flush"))


def test_sleep_and_wake_round_trip_as_verls_worker_calls_them(folders):
    rollout = make_rollout(folders)
    before = rollout.generate_sequences(verl_batch(do_sample=False))
    shape = rollout.engine.config
    asyncio.run(rollout.release())
    assert rollout.engine is None  # the KV cache and the drafter's row state are freed
    with pytest.raises(RuntimeError, match="resume"):
        rollout.generate_sequences(verl_batch(do_sample=False))
    # veRL's update_weights: resume weights, stream them, resume the KV cache
    asyncio.run(rollout.resume(tags=["weights"]))
    asyncio.run(rollout.update_weights(weight_stream(rollout.target)))
    asyncio.run(rollout.resume(tags=["kv_cache"]))
    assert rollout.engine is not None and rollout.engine.config == shape
    after = rollout.generate_sequences(verl_batch(do_sample=False))
    assert torch.equal(after.batch["responses"], before.batch["responses"])
    with pytest.raises(ValueError, match="tags"):
        asyncio.run(rollout.resume(tags=["everything"]))


@pytest.mark.parametrize("field", ["input_ids", "attention_mask", "position_ids"])
def test_a_batch_without_a_needed_field_is_refused_naming_it(folders, field):
    rollout = make_rollout(folders, drafter=False, strategy="plain")
    batch = verl_batch()
    given = {name: tensor.clone() for name, tensor in batch.batch.items()}
    batch.pop(batch_keys=[field])
    with pytest.raises(ValueError, match=field):
        rollout.generate_sequences(batch)
    for name in batch.batch.keys():  # nothing the caller gave is changed
        assert torch.equal(batch.batch[name], given[name])


def test_batches_outside_verls_layout_are_refused_naming_the_field(folders):
    rollout = make_rollout(folders, drafter=False, strategy="plain")
    right_padded = verl_batch()
    right_padded.batch["attention_mask"] = right_padded.batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="attention_mask: row 0 is not left-padded"):
        rollout.generate_sequences(right_padded)
    shifted = verl_batch()
    shifted.batch["position_ids"] = shifted.batch["position_ids"] + 1
    with pytest.raises(ValueError, match="position_ids"):
        rollout.generate_sequences(shifted)
    with pytest.raises(ValueError, match="batch"):
        rollout.generate_sequences(DataProto(meta_info={"eos_token_id": EOS}))


def test_unsupported_settings_are_named_at_construction(folders):
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        make_rollout(folders, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="engine_kwargs.tlt: unknown option"):
        make_rollout(folders, engine_kwargs={"tlt": {"drafter_path": "x"}})
    with pytest.raises(ValueError, match="drafter"):
        make_rollout(folders, drafter=False, strategy="(3,1,4)")
    with pytest.raises(ValueError, match="strategy"):
        make_rollout(folders, strategy="fastest")


@pytest.mark.slow  # the embedded model's adaptive calibration and three generations: a minute
def test_example_runs_its_own_checks_on_the_embedded_model():
    from tests.test_examples import load_example

    result = load_example("verl_rollout_tlt").main(
        ["--prompts", "3", "--samples", "2", "--response-length", "48", "--max-batch", "2"])
    assert result["greedy_equal"] and result["synced_equal"] and result["sync_changed"]
    assert result["logprob_gap_max"] < 1e-4 and result["rows"] == 6
    assert "spec/sd_step_share" in result["metrics"]


def test_verls_external_module_hook_registers_the_backend_in_a_fresh_process():
    """VERL_USE_EXTERNAL_MODULES is veRL's own way to load a plugin at `import verl`."""
    import os
    import subprocess
    import sys

    code = ("from verl.workers.rollout.base import get_rollout_class; "
            "print(get_rollout_class('tlt', 'async').__name__)")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "tlt_core.integrations.verl.registration"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "TLTVerlRollout"


def test_the_installed_entry_point_registers_the_backend_at_import_verl():
    """pyproject's `verl.plugins` entry point: an installed tlt_core is found by `import verl`
    alone, with no environment variable."""
    import os
    import subprocess
    import sys
    from importlib.metadata import entry_points

    if not any(e.name == "tlt" for e in entry_points(group="verl.plugins")):
        pytest.skip("tlt_core is not installed (pip install -e .): no entry points")
    code = ("import verl\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "from verl.workers.rollout.replica import get_rollout_replica_class\n"
            "print(get_rollout_class('tlt', 'async').__name__, "
            "get_rollout_replica_class('tlt').__name__)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "TLTVerlRollout TLTReplica"


def test_sampling_follows_meta_info_over_the_config_as_verls_rollouts_read_it():
    from tlt_core.integrations.verl import read_sampling

    config = RolloutConfig(name="tlt", tensor_model_parallel_size=1, temperature=0.7, top_k=-1,
                           top_p=0.9, response_length=12,
                           val_kwargs=SamplingConfig(do_sample=True, temperature=0.3, top_k=5))
    train = read_sampling({}, config, (EOS,), PAD)
    assert (train.temperature, train.top_k, train.top_p) == (0.7, 0, 0.9)  # -1: top_k off
    assert (train.response_length, train.stop_ids, train.pad_token_id) == (12, (EOS,), PAD)
    given = read_sampling({"temperature": 1.2, "eos_token_id": [3, 4], "pad_token_id": 9,
                           "response_length": 5}, config, (EOS,), PAD)
    assert (given.temperature, given.stop_ids, given.pad_token_id, given.response_length) == \
        (1.2, (3, 4), 9, 5)
    validate = read_sampling({"validate": True}, config, (EOS,), PAD)
    assert (validate.temperature, validate.top_k) == (0.3, 5)  # val_kwargs
    assert read_sampling({"do_sample": False}, config, (EOS,), PAD).temperature == 0.0
    ignore = RolloutConfig(name="tlt", tensor_model_parallel_size=1, ignore_eos=True)
    assert read_sampling({"eos_token_id": EOS}, ignore, (EOS,), PAD).stop_ids == ()


def test_left_padded_prompts_are_what_read_prompts_reads_back():
    from tlt_core.integrations.verl import read_prompts

    tensors = left_padded_prompts([[5, 6, 7], [8]], PAD)
    assert tensors["input_ids"].tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert tensors["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert read_prompts(tensors).prompt_ids == [[5, 6, 7], [8]]
    with pytest.raises(ValueError, match="prompt_ids"):
        left_padded_prompts([[5], []], PAD)
