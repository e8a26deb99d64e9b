"""The suffix index: sibling and previous responses of each prompt, indexed by n-gram, from
which draft tokens are copied instead of drafted by a model.

GRPO samples n responses per prompt and revisits prompts across steps, so a response often
repeats text that a sibling (another sample of the same prompt, running or finished in this
rollout) or an earlier response to that prompt (the previous rollout) already produced. For a
row whose context ends in the n-gram g, `SuffixIndex.propose` finds g in those sequences and
proposes the tokens that followed it. Drafts cost no model pass; the target verifies them with
the same lossless kernels as learned drafts (a deterministic chain), so a wrong proposal only
costs its verification.

Which occurrence: the one whose position is closest to the row's own length (siblings of one
prompt move through the same text at about the same place), ties to the earliest sequence, then
the earliest position: deterministic for a given set of sequences. Sequences are grouped by
prompt ids, whatever request they came from.

`tlt_core.drafting.suffix_match.SuffixMatch(depth)` is the draft plan that asks for such
drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass
class _Sequence:
    prompt: tuple[int, ...]
    tokens: list[int]  # the live response list (grows while the sample runs)
    indexed: int = 0  # n-grams of prompt + tokens[:indexed] are in the group's index

    def token(self, position: int) -> int:
        """Token at position of prompt + response."""
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.tokens[position - n]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.tokens)


@dataclass
class _Group:
    sequences: list[_Sequence] = field(default_factory=list)
    # n-gram -> [(sequence index, position just after the n-gram)], in indexing order
    index: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)


class SuffixIndex:
    """Sibling and previous-rollout sequences per prompt, indexed by n-gram."""

    def __init__(self, ngram: int = 3, history_rounds: int = 1, max_per_prompt: int = 64):
        if ngram < 1:
            raise ValueError(f"ngram: must be >= 1, got {ngram}")
        if history_rounds < 0:
            raise ValueError(f"history_rounds: must be >= 0, got {history_rounds}")
        if max_per_prompt < 1:
            raise ValueError(f"max_per_prompt: must be >= 1, got {max_per_prompt}")
        self.ngram, self.history_rounds, self.max_per_prompt = ngram, history_rounds, max_per_prompt
        self._live: dict[tuple[int, ...], list[_Sequence]] = {}  # this rollout
        self._history: list[dict[tuple[int, ...], list[_Sequence]]] = []  # newest first
        self._groups: dict[tuple[int, ...], _Group] = {}  # built from the two above
        self._handles: dict[object, _Sequence] = {}

    def __len__(self) -> int:
        """Sequences it can copy from: this rollout's and the kept history's."""
        return (sum(map(len, self._live.values()))
                + sum(len(seqs) for rollout in self._history for seqs in rollout.values()))

    def new_round(self) -> None:
        """A new rollout begins: this rollout's sequences become history (the newest
        history_rounds rollouts are kept)."""
        frozen = {prompt: [_Sequence(s.prompt, list(s.tokens)) for s in seqs]
                  for prompt, seqs in self._live.items()}
        if frozen:
            self._history.insert(0, frozen)
        del self._history[self.history_rounds:]
        self._live, self._handles, self._groups = {}, {}, {}

    def add_history(self, prompt_ids: Sequence[int], responses: Iterable[Sequence[int]]) -> None:
        """Earlier responses to a prompt (say, the previous RL step's), as token id lists."""
        prompt = tuple(int(t) for t in prompt_ids)
        if not self._history:
            self._history.append({})
        seqs = self._history[0].setdefault(prompt, [])
        seqs.extend(_Sequence(prompt, [int(t) for t in r]) for r in responses)
        self._groups.pop(prompt, None)  # rebuilt with them on the next proposal

    def track(self, handle: object, prompt_ids: Sequence[int], tokens: list[int]) -> None:
        """A running sample: its response list is read (not copied) whenever proposing."""
        prompt = tuple(prompt_ids)
        sequence = _Sequence(prompt, tokens)
        self._live.setdefault(prompt, []).append(sequence)
        self._handles[handle] = sequence
        group = self._groups.get(prompt)
        if group is not None:
            group.sequences.append(sequence)

    def propose(self, handle: object, depth: int) -> list[int]:
        """Up to depth tokens to follow the tracked sample's context; [] when nothing matches."""
        own = self._handles[handle]
        group = self._group(own.prompt)
        n, length = self.ngram, len(own)
        if length < n:
            return []
        for sequence_index, sequence in enumerate(group.sequences):
            self._index(group, sequence_index, sequence)
        key = tuple(own.token(p) for p in range(length - n, length))
        best = None
        for sequence_index, end in group.index.get(key, ()):
            sequence = group.sequences[sequence_index]
            if sequence is own or end >= len(sequence):
                continue
            rank = (abs(end - length), sequence_index, end)
            if best is None or rank < best[0]:
                best = (rank, sequence, end)
        if best is None:
            return []
        _, sequence, end = best
        return [sequence.token(p) for p in range(end, min(end + depth, len(sequence)))]

    def _group(self, prompt: tuple[int, ...]) -> _Group:
        group = self._groups.get(prompt)
        if group is None:
            sequences = list(self._live.get(prompt, []))
            for rollout in self._history:
                sequences.extend(rollout.get(prompt, []))
            # this rollout's first, then the newest history
            group = self._groups[prompt] = _Group(sequences[:self.max_per_prompt])
            for sequence in group.sequences:
                sequence.indexed = 0
        return group

    def _index(self, group: _Group, sequence_index: int, sequence: _Sequence) -> None:
        """Adds the n-grams that sequence gained since it was last indexed."""
        n, end = self.ngram, len(sequence)
        start = max(sequence.indexed, n)
        if start > end:
            return
        window = [sequence.token(p) for p in range(start - n, end)]  # only what is new
        for position in range(start, end + 1):
            key = tuple(window[position - start:position - start + n])
            group.index.setdefault(key, []).append((sequence_index, position))
        sequence.indexed = end + 1
