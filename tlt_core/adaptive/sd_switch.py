"""When to speculate: on at small running batches, off at large ones, with hysteresis.

SD pays in the tail (few rows: the target pass is cheap, most of the step is fixed cost) and
costs at large batch (verifying N tokens per row multiplies the work). The switch turns SD on
when the running batch is at or below `on_at`, and off again only when it grows above `off_above`
(>= on_at): between the two it keeps its state, so a batch that oscillates around one edge
(continuous batching admitting and finishing rows, multi-turn requests returning) does not flap
between modes and pay the drafter's catch-up each time. `on_at` comes from the calibrated cost
model (CostModel.threshold); `off_above` defaults to twice it.
"""

from __future__ import annotations


class SDSwitch:
    def __init__(self, on_at: int, off_above: int | None = None):
        if not isinstance(on_at, int) or on_at < 0:
            raise ValueError(f"on_at: must be an int >= 0 (0: never on), got {on_at!r}")
        off_above = 2 * on_at if off_above is None else off_above
        if not isinstance(off_above, int) or off_above < on_at:
            raise ValueError(f"off_above: must be an int >= on_at ({on_at}), got {off_above!r}")
        self.on_at, self.off_above = on_at, off_above
        self.on = False
        self.transitions = 0

    def update(self, batch: int) -> bool:
        """The state for a step at this running batch size."""
        if batch < 1:
            raise ValueError(f"batch: must be >= 1, got {batch}")
        now = (batch <= self.on_at) if not self.on else (batch <= self.off_above)
        if now != self.on:
            self.on, self.transitions = now, self.transitions + 1
        return self.on

    def state_dict(self) -> dict:
        return {"on_at": self.on_at, "off_above": self.off_above, "on": self.on,
                "transitions": self.transitions}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(int(state["on_at"]), int(state["off_above"]))
        self.on, self.transitions = bool(state["on"]), int(state["transitions"])
