"""tlt_core's engine chosen from TRL's own config, as TRL chooses vLLM: `use_tlt=True`.

TRL 1.16's GRPOTrainer picks its generator from GRPOConfig switches (`use_vllm`,
`use_transformers_continuous_batching`, else `model.generate`) or, before all of them, a
`rollout_func` given to its constructor. `TLTGRPOConfig` adds the `use_tlt` switch and the
engine's options as config fields (so `HfArgumentParser` / `TrlParser` make them command-line
flags: `--use_tlt --tlt_strategy "(3,1,4)"`), and `TLTGRPOTrainer` turns them into a
`TLTRollout` passed as that rollout_func; everything else is GRPOTrainer's. With use_tlt=False
the trainer is GRPOTrainer.

    from tlt_core.integrations.trl_trainer import TLTGRPOConfig, TLTGRPOTrainer
    config = TLTGRPOConfig(output_dir="out", use_tlt=True, tlt_drafter="drafter/", bf16=False)
    trainer = TLTGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data)

This module imports TRL at its top (the config is a subclass of TRL's); `tlt_core.integrations`
does not import it, so tlt_core stays importable without TRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig, GRPOTrainer

from tlt_core.drafting.plan_keys import plan_from_key
from tlt_core.engine.engine import EngineConfig
from tlt_core.integrations.trl import ADAPTIVE, TLTRollout

__all__ = ["TLTGRPOConfig", "TLTGRPOTrainer", "rollout_from_config"]

PLAIN = "none"


@dataclass
class TLTGRPOConfig(GRPOConfig):
    """GRPOConfig plus the switch that makes tlt_core's engine the generator."""

    use_tlt: bool = field(default=False, metadata={
        "help": "Generate completions with tlt_core's rollout engine (speculative, adaptive, "
                "lossless) instead of model.generate; use TLTGRPOTrainer."})
    tlt_strategy: str = field(default=ADAPTIVE, metadata={
        "help": "'adaptive' (a bandit over draft plans, calibrated at the first generation), "
                "'none' (plain decoding) or a plan key: '(D,K,N)', 'sampled(D)', 'sampled(D,K)', "
                "'suffix(D)'."})
    tlt_drafter: str | None = field(default=None, metadata={
        "help": "A tlt_core drafter folder, loaded onto the engine's copy of the model. Without "
                "one only model-free plans (suffix(D)) draft."})
    tlt_max_batch: int | None = field(default=None, metadata={
        "help": "Engine rows (samples decoding at once); default: the first generation's "
                "sample count."})
    tlt_check_logprobs: bool = field(default=False, metadata={
        "help": "Compare the engine's log-probs with TRL's recomputation at every generation "
                "(one extra forward) and log rollout/sampling_logp_difference/max and /mean."})

    def __post_init__(self):
        super().__post_init__()
        if not self.use_tlt:
            return
        if self.use_vllm:
            raise ValueError("use_tlt: cannot be combined with use_vllm=True; choose one "
                             "generator")
        if self.use_transformers_continuous_batching:
            raise ValueError("use_tlt: cannot be combined with "
                             "use_transformers_continuous_batching=True; choose one generator")
        if self.tlt_strategy not in (ADAPTIVE, PLAIN):
            try:
                plan_from_key(self.tlt_strategy)
            except ValueError as error:
                raise ValueError(f"tlt_strategy: expected {ADAPTIVE!r}, {PLAIN!r} or a plan "
                                 f"key; {error}") from None
        if self.tlt_max_batch is not None and self.tlt_max_batch < 1:
            raise ValueError(f"tlt_max_batch: must be >= 1, got {self.tlt_max_batch}")


def rollout_from_config(args: TLTGRPOConfig) -> TLTRollout:
    """The TLTRollout that args' tlt_* fields describe."""
    if args.tlt_strategy == ADAPTIVE:
        strategy = ADAPTIVE
    elif args.tlt_strategy == PLAIN:
        strategy = None
    else:
        strategy = plan_from_key(args.tlt_strategy)
    engine_config = (None if args.tlt_max_batch is None
                     else EngineConfig(max_batch=args.tlt_max_batch))
    return TLTRollout(drafter=args.tlt_drafter, strategy=strategy, engine_config=engine_config,
                      seed=args.seed, check_logprobs=args.tlt_check_logprobs)


class TLTGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that generates with tlt_core's engine when `args.use_tlt` is set.
    `self.tlt_rollout` is the TLTRollout (its `calls` record every generation), None otherwise.
    Every argument is GRPOTrainer's."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *positional,
                 rollout_func=None, **kwargs):
        use_tlt = bool(getattr(args, "use_tlt", False))
        if use_tlt and rollout_func is not None:
            raise ValueError("rollout_func: use_tlt=True makes tlt_core's engine the "
                             "rollout_func; pass one or the other")
        self.tlt_rollout = rollout_from_config(args) if use_tlt else None
        if self.tlt_rollout is not None:
            rollout_func = self.tlt_rollout
        super().__init__(model, reward_funcs, args, *positional, rollout_func=rollout_func,
                         **kwargs)
