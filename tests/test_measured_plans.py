"""Plans from a `tlt bench speculative --json` file: the best plan per batch size at the run's
temperature (ties by acceptance), the bench's rates as the adaptive loop's prediction where
calibration timed nothing, bad files named; the RL driver and `tlt bench rollout` adapt over
exactly the file's best plans, and the command lines name --plans-from."""

import json
import math

import pytest
import torch

from tests.speculative_fixtures import PROMPTS, tiny_target
from tlt_core.adaptive.cost_model import CostModel
from tlt_core.adaptive.measured_plans import measured_plans
from tlt_core.adaptive.policy import AdaptivePolicy
from tlt_core.bench import rollout as bench_rollout
from tlt_core.bench.train import TrainOptions
from tlt_core.cli.main import main
from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy
from tlt_core.engine.records import Request, SamplingParams
from tlt_core.rl.driver import RLDriver, TrainConfig, _adaptive_plans
from tlt_core.tasks.inputs import Prompt

CHAIN, TREE, SAMPLED = Strategy(3, 1, 4), Strategy(3, 2, 6), SampledChain(3)


def row(batch, plan, speedup, temperature=1.0, acceptance=2.0, plain_tok_s=None):
    """A row as `tlt bench speculative --json` writes it (the fields this module reads, and
    some it does not)."""
    plain = plain_tok_s if plain_tok_s is not None else 10.0 * batch
    return {"batch": batch, "plan": plan.key, "acceptance_length": acceptance,
            "sd_tok_s": plain * speedup, "plain_tok_s": plain, "speedup_vs_plain": speedup,
            "temperature": temperature, "requests": 2 * batch, "tokens": 100,
            "model": "tiny (float32)", "greedy_equal": None}


# T = 1: SAMPLED wins at 1 (a tie on speedup with CHAIN, broken by acceptance) and at 64, CHAIN
# at 4 and 16 (at 16 below plain decoding: still the best plan there). T = 0: TREE wins at 1.
ROWS = [row(4, CHAIN, 1.4), row(4, SAMPLED, 1.2),
        row(1, CHAIN, 1.8, acceptance=3.0), row(1, SAMPLED, 1.8, acceptance=3.5),
        row(1, TREE, 1.5),
        row(16, SAMPLED, 0.8), row(16, CHAIN, 0.9),
        row(64, CHAIN, 0.6), row(64, SAMPLED, 0.7),
        row(1, TREE, 2.5, temperature=0.0), row(1, CHAIN, 2.0, temperature=0.0),
        row(4, CHAIN, 1.3, temperature=0.0)]


def test_the_best_plan_per_batch_wins_on_speedup_then_acceptance():
    measured = measured_plans(ROWS, 1.0)
    assert measured.best == {1: SAMPLED, 4: CHAIN, 16: CHAIN, 64: SAMPLED}
    assert list(measured.best) == [1, 4, 16, 64]  # ordered by batch, not by the file
    assert measured.plans == (SAMPLED, CHAIN)  # distinct, in order of the first batch won
    assert measured.source == "rows" and measured.temperature == 1.0
    # equal speedup and acceptance: the earlier row
    tied = [row(2, CHAIN, 1.5), row(2, SAMPLED, 1.5)]
    assert measured_plans(tied, 1.0).best == {2: CHAIN}
    assert measured_plans(tied[::-1], 1.0).best == {2: SAMPLED}


def test_only_rows_at_the_temperature_count(tmp_path):
    greedy = measured_plans(ROWS, 0)
    assert greedy.best == {1: TREE, 4: CHAIN} and greedy.plans == (TREE, CHAIN)
    assert greedy.speedups == {(1, TREE.key): 2.5, (1, CHAIN.key): 2.0, (4, CHAIN.key): 1.3}
    path = tmp_path / "speculative.json"
    path.write_text(json.dumps(ROWS))
    from_file = measured_plans(path, 1.0)
    assert from_file.best == measured_plans(ROWS, 1.0).best
    assert from_file.source == str(path)
    assert TREE.key not in {plan.key for plan in from_file.plans}  # lost at T = 1


def test_the_cost_model_is_plain_rate_times_speedup_and_fills_gaps():
    rows = [row(1, CHAIN, 2.0, plain_tok_s=10.0), row(1, SAMPLED, 1.5, plain_tok_s=12.0),
            row(1, TREE, 1.2, plain_tok_s=11.0),
            row(16, SAMPLED, 0.9, plain_tok_s=100.0), row(16, CHAIN, 0.5, plain_tok_s=100.0)]
    measured = measured_plans(rows, 1.0)
    assert measured.plain_tok_s == {1: 11.0, 16: 100.0}  # the median of the batch's rows
    model = measured.cost_model((CHAIN, TREE, SuffixMatch(8)))
    assert model.rate(1, None) == 11.0 and model.rate(16, None) == 100.0
    assert model.rate(1, CHAIN) == pytest.approx(22.0)
    assert model.rate(16, CHAIN) == pytest.approx(50.0)
    # TREE ran at batch 1 only: its speedup is held there; at 4 plain is interpolated
    assert model.rate(16, TREE) == pytest.approx(120.0)
    plain_at_4 = 0.5 * (11.0 + 100.0)  # log2(4) is halfway from log2(1) to log2(16)
    assert model.rate(4, None) == pytest.approx(plain_at_4)
    assert model.rate(4, TREE) == pytest.approx(0.5 * (11.0 * 1.2 + 100.0 * 1.2))
    # a plan the bench never ran (suffix-match drafts): predicted as plain decoding
    assert model.rate(1, SuffixMatch(8)) == 11.0 and model.rate(16, SuffixMatch(8)) == 100.0
    assert measured.speedup(4, SAMPLED) == pytest.approx(0.5 * (1.5 + 0.9))
    assert measured.speedup(4, SuffixMatch(8)) is None


def test_the_bench_rates_are_the_prior_where_calibration_timed_nothing():
    measured = measured_plans(ROWS, 1.0)
    plans = measured.plans
    policy = AdaptivePolicy.from_cost_model(CostModel({}), plans, 64,
                                            fallback_model=measured.cost_model(plans))
    # each batch: its best plan where it beats plain decoding, plain where none does
    assert [policy.best(batch, 0) for batch in (1, 4, 16, 64)] == [SAMPLED, CHAIN, None, None]
    # calibration stays the prediction where it timed batches: here plain wins everywhere
    calibrated = CostModel({(batch, key): rate for batch in (1, 64)
                            for key, rate in (("plain", 10.0 * batch), (SAMPLED.key, 1.0),
                                              (CHAIN.key, 1.0))})
    policy = AdaptivePolicy.from_cost_model(calibrated, plans, 64,
                                            fallback_model=measured.cost_model(plans))
    assert [policy.best(batch, 0) for batch in (1, 4, 16, 64)] == [None] * 4
    # without either, no prediction: every arm alike, plain first on ties
    assert AdaptivePolicy.from_cost_model(CostModel({}), plans, 64).predict(1, 0, CHAIN) == 1.0


def _with(index, **changes):
    rows = [dict(r) for r in ROWS]
    rows[index].update(changes)
    return [{k: v for k, v in r.items() if v is not _DROP} for r in rows]


_DROP = object()


@pytest.mark.parametrize("rows, match", [
    ({"rows": ROWS}, r"rows: holds a dict; expected the list of rows that `tlt bench "
                     r"speculative --json FILE` writes"),
    ([], "rows: holds no rows"),
    (["(3,1,4)"], r"rows\[0\] is a str, expected a row of `tlt bench speculative"),
    (_with(2, speedup_vs_plain=_DROP), r"rows\[2\] has no 'speedup_vs_plain'"),
    (_with(0, batch=_DROP, plan=_DROP), r"rows\[0\] has no 'batch', 'plan'"),
    (_with(3, batch=0), r"rows\[3\]: 'batch' must be an int >= 1, got 0"),
    (_with(1, speedup_vs_plain=math.nan),
     r"rows\[1\]: 'speedup_vs_plain' must be a finite number > 0"),
    (_with(1, plain_tok_s=-1.0), r"rows\[1\]: 'plain_tok_s' must be a finite number > 0"),
    (_with(5, plan="(3,1)"), r"rows\[5\]: 'plan': '\(3,1\)' is no shipped plan's key"),
    (_with(4, temperature=0.0, plan=TREE.key, batch=1),
     r"rows\[4\] and rows\[9\] both measure \(3,2,6\) at batch 1"),
    (_with(6, model="other (bfloat16)"), r"several models \(other \(bfloat16\), tiny"),
], ids=["not_a_list", "empty", "not_a_row", "no_speedup", "no_batch_plan", "bad_batch",
        "nan_speedup", "bad_plain_rate", "unknown_plan", "duplicate", "two_models"])
def test_bad_rows_are_named(rows, match):
    with pytest.raises(ValueError, match=match):
        measured_plans(rows, 1.0 if "both measure" not in match else 0.0)


def test_bad_files_and_temperatures_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"no rows at temperature 0.7; it has rows at 0.0, 1.0 "
                                         r"\(0: greedy\); run `tlt bench speculative "
                                         r"--temperature 0.7"):
        measured_plans(ROWS, 0.7)
    with pytest.raises(ValueError, match="temperature: must be a finite number >= 0"):
        measured_plans(ROWS, -1.0)
    broken = tmp_path / "broken.json"
    broken.write_text("[{\"batch\": 1,")
    with pytest.raises(ValueError, match=r"broken.json: not a JSON file"):
        measured_plans(broken, 1.0)
    rollout = tmp_path / "rollout.json"
    rollout.write_text(json.dumps({"model": "tiny", "rows": []}))
    with pytest.raises(ValueError, match=r"rollout.json: holds a dict"):
        measured_plans(rollout, 1.0)
    with pytest.raises(FileNotFoundError, match=r"missing.json: no such file; write one with "
                                                r"`tlt bench speculative --json FILE`"):
        measured_plans(tmp_path / "missing.json", 1.0)


# ---- the RL driver and `tlt bench rollout` on the tiny model ---------------------------------

@pytest.fixture(scope="module")
def models():
    """The tiny target and an untrained drafter: which plans the loop adapts over does not
    depend on how well they draft."""
    torch.manual_seed(0)
    target = tiny_target(sharpen=2.0)
    return target, Drafter(target, DrafterConfig()).eval()


@pytest.fixture
def plans_file(tmp_path):
    path = tmp_path / "speculative_t1.json"
    path.write_text(json.dumps(ROWS))
    return path


def _driver(models, **options):
    target, drafter = models
    config = TrainConfig(**{**dict(steps=1, prompts_per_step=2, samples_per_prompt=2,
                                   max_new_tokens=6, minibatch_size=4, max_batch=4, lr=1e-3,
                                   suffix_drafts=False), **options})
    prompts = [Prompt(str(p), tuple(p), "7") for p in PROMPTS[:4]]
    return RLDriver(target, prompts, lambda prompt, response, reference: 0.0,
                    lambda ids: " ".join(map(str, ids)), (), config, drafter=drafter)


def test_the_driver_adapts_over_exactly_the_files_best_plans(models, plans_file):
    driver = _driver(models, plans_from=plans_file)
    assert driver.adaptive.plans == (SAMPLED, CHAIN)
    assert {key for _, key in driver.adaptive.cost_model.rates} == {"plain", SAMPLED.key,
                                                                     CHAIN.key}
    config = TrainConfig(plans_from=str(plans_file))
    assert config.plans_from == plans_file  # text becomes a path
    plans, measured = _adaptive_plans(config)  # suffix-match plans beside the file's
    assert plans == (SAMPLED, CHAIN, SuffixMatch(8), SuffixMatch(16))
    assert measured.best == measured_plans(ROWS, 1.0).best


def test_the_plans_file_goes_into_a_checkpoint_as_text(models, plans_file, tmp_path):
    saved = _driver(models, plans_from=plans_file, tlt=False).save(tmp_path / "checkpoints")
    _driver(models, plans_from=plans_file, tlt=False).resume(saved)
    copy = tmp_path / "copy.json"
    copy.write_text(plans_file.read_text())
    with pytest.raises(ValueError, match=r"checkpoint: saved under another config \(plans_from "
                                         r"differ\)"):
        _driver(models, plans_from=copy, tlt=False).resume(saved)
    # a checkpoint written before the option existed ran at its default
    state = _driver(models, tlt=False).state_dict()
    del state["config"]["plans_from"]
    _driver(models, tlt=False).load_state_dict(state)


def test_the_driver_names_a_bad_plans_file(models, tmp_path):
    bad = tmp_path / "greedy.json"
    bad.write_text(json.dumps([r for r in ROWS if r["temperature"] == 0.0]))
    with pytest.raises(ValueError, match=r"plans_from: .*greedy.json: no rows at temperature "
                                         r"1.0; it has rows at 0.0"):
        _driver(models, plans_from=bad)
    with pytest.raises(ValueError, match="sampled_drafts: with plans_from"):
        TrainConfig(plans_from=bad, sampled_drafts=True)
    _driver(models, plans_from=bad, tlt=False)  # SD off: no plans to read


def test_bench_rollout_adapts_over_exactly_the_files_best_plans(models, plans_file,
                                                                monkeypatch):
    """A calibration that timed nothing (stubbed: the test is about the plans, and an empty
    one is the case where the file's rates are the loop's prediction)."""
    target, drafter = models
    monkeypatch.setattr(bench_rollout, "calibrate", lambda *args, **kwargs: CostModel({}))
    policies = []
    from_cost_model = AdaptivePolicy.from_cost_model

    def spy(*args, **kwargs):
        policies.append((from_cost_model(*args, **kwargs), kwargs["fallback_model"]))
        return policies[-1][0]
    monkeypatch.setattr(AdaptivePolicy, "from_cost_model", spy)
    workloads = bench_rollout.build_workloads(
        [tuple(PROMPTS[0])], (), [Request(tuple(PROMPTS[2]), SamplingParams(max_tokens=4))],
        ("no_tail",), samples=3, max_tokens=4, trace_lengths=[4] * 3)
    measured = measured_plans(plans_file, bench_rollout.TEMPERATURE)
    result = bench_rollout.run(target, drafter, workloads, rounds=1, max_batch=2, always=CHAIN,
                               measured=measured, progress=False, label="tiny")
    detail = result["workloads"]["no_tail"]
    assert detail["plans"] == [SAMPLED.key, CHAIN.key]
    assert detail["plans_from"] == str(plans_file)
    [(policy, fallback)] = policies
    assert policy.plans == (SAMPLED, CHAIN)
    assert fallback.rates == measured.cost_model(measured.plans).rates
    assert policy.predict(1, 0, SAMPLED) == pytest.approx(18.0)  # 1.8 x plain's 10 tok/s
    arms = set()
    for run in detail["runs"]["adaptive"]:
        column = run["step_trace"]["columns"].index("arm")
        arms |= {step[column] for step in run["step_trace"]["rows"]}
    assert arms and arms <= {"plain", SAMPLED.key, CHAIN.key}
    json.dumps(result)
    with pytest.raises(ValueError, match="sampled_drafts"):
        bench_rollout.run(target, drafter, workloads, measured=measured, sampled_drafts=True)


def test_bench_train_hands_the_file_to_its_runs(plans_file):
    config = TrainOptions(plans_from=plans_file).train_config()
    assert config.plans_from == plans_file
    assert json.loads(json.dumps(config.as_record()))["plans_from"] == str(plans_file)


def test_the_command_lines_name_plans_from(plans_file, tmp_path):
    missing = str(tmp_path / "missing.json")
    for command in (["train"], ["bench", "rollout"], ["bench", "train"]):
        with pytest.raises(SystemExit, match="--plans-from: .*missing.json: no such file"):
            main([*command, "--plans-from", missing, "--no-progress"])
    with pytest.raises(SystemExit, match=r"--plans-from: .*no rows at temperature 1.0"):
        greedy = tmp_path / "greedy.json"
        greedy.write_text(json.dumps([r for r in ROWS if r["temperature"] == 0.0]))
        main(["bench", "rollout", "--plans-from", str(greedy), "--no-progress"])
    for command in (["train"], ["bench", "rollout"], ["bench", "train"]):
        with pytest.raises(SystemExit, match="--sampled-drafts: with"):
            main([*command, "--plans-from", str(plans_file), "--sampled-drafts",
                  "--no-progress"])
