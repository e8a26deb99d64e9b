"""Drafting: what proposes the tokens a speculative step verifies, and how the drafter learns.

`drafter.py` is the one-layer EAGLE-style drafter that shares the target's embedding, final norm
and LM head; `learned.py` the `LearnedDrafter` protocol (what the engine needs of a drafter)
that it and `eagle3.py`'s drafter follow; `plan.py` the `DraftPlan` protocol every draft plan
follows, and `plan_keys.py` a shipped plan back from its key; `tree.py` the learned drafter's
plan (`Strategy`: depth, top-k, tokens verified) and how its EAGLE-2 tree is grown;
`suffix_index.py` and `suffix_match.py` drafts copied from sibling and earlier responses, with
no model pass; `training.py` the drafter's loss (EAGLE's, plus a sampled rejection term) on
records of what the target computed; `export.py` drafters in the layouts vLLM, SGLang and
speculators load (EAGLE-1 for ours, EAGLE-3 through `eagle3_layouts.py`), and `load_drafter`,
which reads any drafter folder; `published.py` the drafter checkpoints other projects publish
(SafeAILab EAGLE-1/2, EAGLE-3 from SafeAILab, SpecForge, SGLang and speculators); `eagle3.py`
the EAGLE-3 drafter those become. Nothing here decides when to speculate or runs a rollout
(tlt_core.engine, tlt_core.adaptive).
"""

from tlt_core.drafting.drafter import Drafter, DrafterConfig
from tlt_core.drafting.eagle3 import Eagle3Config, Eagle3Drafter
from tlt_core.drafting.export import (EXPORT_FORMATS, export_drafter, exportable, load_drafter,
                                      load_export)
from tlt_core.drafting.learned import LearnedDrafter
from tlt_core.drafting.plan import DraftContext, DraftPlan
from tlt_core.drafting.published import load_published
from tlt_core.drafting.suffix_index import SuffixIndex
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.training import (DraftBatch, DraftRecord, collect_records, eagle_loss,
                                        make_batch, make_optimizer, train_step)
from tlt_core.drafting.tree import Strategy, draft_tree

__all__ = ["DraftBatch", "DraftContext", "DraftPlan", "DraftRecord", "Drafter", "DrafterConfig",
           "EXPORT_FORMATS", "Eagle3Config", "Eagle3Drafter", "LearnedDrafter", "Strategy",
           "SuffixIndex", "SuffixMatch", "collect_records", "draft_tree", "eagle_loss",
           "export_drafter", "exportable", "load_drafter", "load_export", "load_published",
           "make_batch", "make_optimizer", "train_step"]
