"""`tlt bench train`: the trace workload decodes every sample to exactly its drawn length, the
same lengths in every run, with GRPO's groups intact; per-token rates and the noise floor from
hand-made rows; the adaptive loop's calibration counted in TLT's first step; bad workloads and
trace files named."""

import json
from dataclasses import replace

import pytest
import torch

from tests.speculative_fixtures import PROMPTS, VOCAB, tiny_target, train_drafter
from tlt_core.bench import train as bench_train
from tlt_core.bench.train import RUNS, TRACE_COLUMNS, TraceLengths, TrainOptions
from tlt_core.cli.main import main
from tlt_core.rl.driver import RLDriver, TrainConfig
from tlt_core.tasks.inputs import Prompt, TrainInputs

CONFIG = TrainConfig(steps=2, prompts_per_step=2, samples_per_prompt=3, max_new_tokens=12,
                     minibatch_size=6, max_batch=8, lr=1e-3)


def tiny_inputs() -> TrainInputs:
    """The tiny target and drafter on a few prompts; every token is a stop id, so a natural
    response is one token long and a forced one reaches its length only if stop ids are
    dropped."""
    torch.manual_seed(0)
    target = tiny_target(sharpen=2.0)
    prompts = [Prompt(str(p), tuple(p), "7") for p in PROMPTS[:6]]
    return TrainInputs(target, train_drafter(target, steps=20), prompts, prompts[:2],
                       lambda prompt, response, reference: float(len(response) % 3 == 0),
                       lambda ids: " ".join(map(str, ids)), tuple(range(VOCAB)), "tiny", [])


def test_trace_lengths_are_exact_equal_across_runs_and_calibration_is_in_step_zero():
    trace = bench_train.trace_lengths(TrainOptions(workload="trace", trace_median=5,
                                                   trace_sigma=1.0), CONFIG)
    assert len(trace.lengths) == 2 * 2 * 3 and max(trace.lengths) <= CONFIG.max_new_tokens
    result = bench_train.run(CONFIG, progress=False, inputs=tiny_inputs, trace=trace)
    assert result["workload"] == {"name": "trace", "lengths": trace.source}
    rows = {(r["run"], r["step"]): r for r in result["rows"]}
    assert set(rows) == {(run, step) for run, _, _ in RUNS for step in (0, 1)}
    for (run, step), row in rows.items():
        drawn = [trace(step, prompt, sample) for prompt in range(2) for sample in range(3)]
        assert row["response_lengths"] == drawn, (run, step)
        assert row["tokens"] == sum(drawn)
        assert row["tok_s"] == pytest.approx(row["tokens"] / row["step_s"])
        assert row["rollout_tok_s"] == pytest.approx(row["tokens"] / row["rollout_s"])
        trace_rows = row["step_trace"]["rows"]
        assert row["step_trace"]["columns"] == list(TRACE_COLUMNS) and trace_rows
        emitted = sum(r[TRACE_COLUMNS.index("emitted")] for r in trace_rows)
        assert emitted + len(drawn) == row["tokens"]  # each first token comes from prefill
        if run.startswith("off"):
            assert {r[TRACE_COLUMNS.index("arm")] for r in trace_rows} == {"plain"}
        assert row["calibration_cached"] is False
        if (run, step) == ("tlt", 0):  # the adaptive loop calibrated for this step
            assert row["calibration_s"] > 0
            assert row["rollout_s"] > row["calibration_s"]
            assert row["step_s"] >= row["calibration_s"] + row["train_s"]
        else:
            assert row["calibration_s"] == 0
    summary = result["summary"]
    assert summary["tokens"]["tlt"] == summary["tokens"]["off"] == summary["tokens"]["off_seed2"]
    assert summary["calibration_s"]["tlt"] == rows["tlt", 0]["calibration_s"]
    json.dumps(result)  # the JSON keeps all of it
    assert "per token: TLT" in bench_train.format_table(result)


def test_forced_lengths_keep_grpo_groups_and_bad_lengths_are_named():
    inputs = tiny_inputs()

    def driver(forced_lengths, **overrides):
        return RLDriver(inputs.policy, inputs.prompts, inputs.reward_fn, inputs.detokenize,
                        inputs.stop_ids, replace(CONFIG, tlt=False, **overrides),
                        forced_lengths=forced_lengths)

    assert {len(r.tokens) for r in driver(None)._collect(step=0).rollouts} == {1}  # natural
    lengths = TraceLengths((4, 1, 12, 7, 2, 9), 2, 3, "hand-made")
    batch = driver(lengths)._collect(step=0)
    assert len(batch.prompts) == 2 and len(batch.rollouts) == 6
    for j, rollout in enumerate(batch.rollouts):  # group by group, as the advantages read them
        prompt, sample = divmod(j, 3)
        assert (rollout.request_index, rollout.sample_index) == (prompt, sample)
        assert rollout.prompt_ids == batch.prompts[prompt].ids
        assert len(rollout.tokens) == lengths(0, prompt, sample)
    # siblings draw their own samples (each its own seed)
    firsts = [tuple(r.tokens[:1].tolist()) for r in batch.rollouts]
    assert len(set(firsts)) > 1
    # too many stop ids to mask (every token) are dropped; a model's few are masked instead
    tallies = torch.bincount(torch.cat([r.tokens for r in batch.rollouts]))
    stops = tuple(int(t) for t in tallies.topk(2).indices)
    masked = RLDriver(inputs.policy, inputs.prompts, inputs.reward_fn, inputs.detokenize, stops,
                      replace(CONFIG, tlt=False), forced_lengths=lengths)._collect(step=0)
    for j, rollout in enumerate(masked.rollouts):
        assert len(rollout.tokens) == lengths(0, *divmod(j, 3))
        assert not set(rollout.tokens.tolist()) & set(stops)
    with pytest.raises(ValueError, match=r"forced_lengths: step 0, prompt 0, sample 0 got 13"):
        driver(lambda step, prompt, sample: 13).step()  # past max_new_tokens
    with pytest.raises(ValueError, match="forced_lengths: .* got 0"):
        driver(lambda step, prompt, sample: 0).step()
    with pytest.raises(ValueError, match="forced_lengths: .*mask_truncated_completions"):
        driver(lengths, mask_truncated_completions=True)
    with pytest.raises(ValueError, match="forced_lengths: .*old_logprobs recompute or auto"):
        driver(lengths, old_logprobs="rollout")


def test_per_token_summary_from_hand_made_rows():
    """Rates are total tokens over total seconds (not a mean of per-step rates); the time
    ratios stay beside them."""
    steps = {  # run: [(tokens, step_s, rollout_s) per step]
        "tlt": [(300, 1.0, 0.5), (100, 3.0, 1.5)],  # 400 tokens / 4 s; rollout / 2 s
        "off": [(200, 4.0, 3.0), (300, 6.0, 5.0)],  # 500 / 10 s; rollout / 8 s
        "off_seed2": [(225, 5.0, 4.0), (225, 5.0, 4.0)],  # 450 / 10 s; rollout / 8 s
    }
    rows = [{"run": run, "step": step, "tokens": tokens, "step_s": step_s,
             "rollout_s": rollout_s, "train_s": step_s - rollout_s, "calibration_s": 0.0,
             "calibration_cached": False,
             "tok_s": tokens / step_s, "rollout_tok_s": tokens / rollout_s,
             "reward": 0.5, "logprob_gap": 0.0, "response_lengths": [tokens // 2] * 2}
            for run, per_step in steps.items() for step, (tokens, step_s, rollout_s)
            in enumerate(per_step)]
    rows[0]["calibration_s"] = 0.25
    summary = bench_train.summarize(rows)
    assert summary["tok_s"] == {"tlt": 100.0, "off": 50.0, "off_seed2": 45.0}
    assert summary["rollout_tok_s"] == {"tlt": 200.0, "off": 62.5, "off_seed2": 56.25}
    assert summary["speedup_per_token"] == pytest.approx(2.0)
    assert summary["rollout_speedup_per_token"] == pytest.approx(3.2)
    assert summary["noise_per_token"] == pytest.approx(0.9)
    assert summary["rollout_noise_per_token"] == pytest.approx(0.9)
    assert summary["speedup"] == pytest.approx(2.5)  # per-step time: 10 s / 4 s
    assert summary["rollout_speedup"] == pytest.approx(4.0)
    assert summary["calibration_s"] == {"tlt": 0.25, "off": 0.0, "off_seed2": 0.0}
    assert summary["speedup_per_token_after_calibration"] == pytest.approx(400 / 3.75 / 50)
    assert summary["calibration_cached"] is False
    table = bench_train.format_table({"model": "hand-made", "workload": {"name": "natural"},
                                      "rows": rows, "summary": summary})
    assert "per token: TLT 2.00x SD off end to end (3.20x on the rollout)" in table
    assert "SD off reseeded over SD off: 0.90x (0.90x)" in table
    assert "per-step time: TLT 2.50x SD off end to end (4.00x on the rollout" in table


def test_bad_workload_and_trace_file_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "train", "--workload", "natral"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--workload" in error and "natral" in error
    negative = tmp_path / "lengths.txt"
    negative.write_text("12\n-3\n")
    with pytest.raises(SystemExit, match=r"--trace-file: .*lengths.txt\[1\]: .*>= 1 token, got -3"):
        main(["bench", "train", "--workload", "trace", "--trace-file", str(negative)])
    with pytest.raises(SystemExit, match="--trace-file: .*--workload trace"):
        main(["bench", "train", "--trace-file", str(negative)])
    with pytest.raises(SystemExit, match="--trace-sigma: must be >= 0"):
        main(["bench", "train", "--workload", "trace", "--trace-sigma", "-1"])


def test_the_runs_learning_rate_can_be_set_and_a_bad_value_is_named():
    """--lr: a pre-trained model's runs at its own rate, not the embedded model's default."""
    assert TrainOptions(lr=1e-5).train_config().lr == 1e-5
    assert TrainOptions().train_config().lr == TrainConfig().lr
    with pytest.raises(ValueError, match="^lr"):
        TrainOptions(lr=-1.0).train_config()
    with pytest.raises(SystemExit, match="--lr"):
        main(["bench", "train", "--lr", "-1"])


def test_the_runs_engine_rows_can_be_set_and_a_bad_value_is_named():
    """--max-batch sizes each run's engine (its KV cache: the three runs hold theirs at once)."""
    assert TrainOptions(max_batch=16).train_config().max_batch == 16
    assert TrainOptions().train_config().max_batch == TrainConfig().max_batch
    with pytest.raises(ValueError, match="^max_batch: must be an int >= 1"):
        TrainOptions(max_batch=0).train_config()
