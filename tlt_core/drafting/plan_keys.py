"""A shipped plan from its key: the inverse of `DraftPlan.key` for `Strategy` ("(D,K,N)"),
`SampledChain` ("sampled(D)"), `SampledTree` ("sampled(D,K)") and `SuffixMatch` ("suffix(D)"),
for what keeps plans by key (a calibration file, a rollout's step trace) and must act on them
again."""

from __future__ import annotations

import re

from tlt_core.drafting.plan import DraftPlan
from tlt_core.drafting.sampled_chain import SampledChain
from tlt_core.drafting.sampled_tree import SampledTree
from tlt_core.drafting.suffix_match import SuffixMatch
from tlt_core.drafting.tree import Strategy

_STRATEGY = re.compile(r"\((\d+),(\d+),(\d+)\)")
_CHAINS = {"sampled": SampledChain, "suffix": SuffixMatch}
_CHAIN = re.compile(r"(sampled|suffix)\((\d+)\)")
_SAMPLED_TREE = re.compile(r"sampled\((\d+),(\d+)\)")


def plan_from_key(key: str) -> DraftPlan:
    """The plan whose `key` is key; ValueError naming it for any other text."""
    if not isinstance(key, str):
        raise ValueError(f"key: a plan key is a string, got {key!r}")
    strategy = _STRATEGY.fullmatch(key)
    if strategy:
        return Strategy(*(int(number) for number in strategy.groups()))
    chain = _CHAIN.fullmatch(key)
    if chain:
        return _CHAINS[chain.group(1)](int(chain.group(2)))
    tree = _SAMPLED_TREE.fullmatch(key)
    if tree:
        return SampledTree(int(tree.group(1)), int(tree.group(2)))
    raise ValueError(f"key: {key!r} is no shipped plan's key (\"(D,K,N)\", \"sampled(D)\", "
                     "\"sampled(D,K)\" or \"suffix(D)\")")
