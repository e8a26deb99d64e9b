"""A tiny target and drafters for the speculative-rollout tests (CPU and GPU)."""

import random

import torch

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.plan import DraftContext
from tlt_core.drafting.training import collect_records, make_batch, make_optimizer, train_step
from tlt_core.engine import EngineConfig, Request, RolloutEngine, SamplingParams
from tlt_core.model.transformer import ModelConfig, Transformer

VOCAB = 40
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13, 14, 15], [20, 21],
           [30, 31, 32, 33, 34, 35], [7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]


def tiny_target(vocab: int = VOCAB, seed: int = 0, sharpen: float = 8.0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)).eval()
    with torch.no_grad():  # sharper logits than init, so outputs are not uniform noise
        model.lm_head.weight.mul_(sharpen)
    return model


def tiny_target_with_a_final_norm() -> Transformer:
    """tiny_target with a final norm that is not the identity, so misplacing it shows."""
    target = tiny_target()
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)
    return target


def train_drafter(target: Transformer, steps: int = 150, draft_to_target=None,
                  **config) -> Drafter:
    """A drafter trained briefly on the target's own greedy continuations of random prompts;
    config: DrafterConfig's fields (draft_to_target with its draft_vocab)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.config.vocab_size, (4,), generator=g).tolist()
               for _ in range(64)]
    engine = RolloutEngine(target, EngineConfig(max_batch=64, max_len=40))
    rollouts = engine.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=32))
                                for p in prompts]).rollouts
    drafter = Drafter(target, DrafterConfig(**config), draft_to_target)
    records = collect_records(target, [list(r.prompt_ids) + r.tokens.tolist() for r in rollouts],
                              drafter.config.feature_layers)
    optimizer, order = make_optimizer(drafter, 3e-3), random.Random(0)
    for _ in range(steps):
        train_step(drafter, optimizer, make_batch(order.sample(records, 16)))
    return drafter.eval()


class SwitchingPolicy:
    """A PlanPolicy that cycles through plain decoding and every plan, one step each, whatever
    the batch or the measured seconds: it changes arm, and mode, at every step, as the
    losslessness tests need, and does so deterministically (the adaptive policy's choices
    depend on the machine's timing)."""

    def __init__(self, plans):
        self.arms = (None,) + tuple(plans)
        self.steps = 0

    def start_call(self) -> None:
        self.steps = 0

    def choose(self, batch: int, context: int):
        arm = self.arms[self.steps % len(self.arms)]
        self.steps += 1
        return arm

    def observe(self, outcome) -> None:
        pass


def same_seed_draft_context(target: Transformer, drafter: Drafter) -> DraftContext:
    """Three rows at T = 1 for a sampled plan's draft: rows 0 and 2 share their seed and their
    drafter input (so their drafts must be equal), row 1 differs in both."""
    cache = drafter.new_cache(3, 32)
    cache.set_lengths(2)
    hidden = torch.randn(3, target.config.hidden_size)
    sampling = dict(temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.int32),
                    top_p=torch.ones(3), seed=torch.tensor([5, 6, 5]),
                    offset=torch.tensor([1, 1, 1]))
    return DraftContext(torch.tensor([3, 3, 3]), [0, 1, 2], None, drafter, cache,
                        hidden[[0, 1, 0]], sampling)
