"""CUDA graphs of fixed-shape passes, per key, in one shared memory pool (or one per graph, to
measure what sharing saves).

A decode or verify pass of a small batch is bound by kernel launches; a CUDA graph replays the
whole pass as one launch. Shapes must be fixed, so a pass is captured per key (the engine's
keys: tlt_core.engine.step_graphs). Graphs sharing one pool may overlap their intermediate
buffers, since only one runs at a time: that is what makes keeping a graph for every bucket and
strategy affordable (TLT reports 30.4 GB naive -> 10.7 GB).

`run(key, fn, *inputs)`: on CUDA, the first call for a key captures fn (in `_capture`, the one
place that captures: `eager_runs` warm-up calls of fn run for real first, on a side stream, so
fn must be harmless to run: the engine's passes only write uncommitted cache slots), later
calls copy the inputs into the graph's static inputs and replay. The outputs are the graph's
static tensors. They are valid until the next replay of that key, and, in a shared pool, of any
graph captured before it (whose intermediates may lie where this graph's outputs do): a caller
copies what it keeps across replays. The static inputs are ordinary allocations, stable until
`clear`. On the CPU (or with enabled=False) it calls fn eagerly: the same interface. Memory:
`capture_bytes` per key is what each capture added to reserved memory; `reserved_bytes` their
total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static input buffers
    outputs: Any  # what fn returned during capture (static tensors)


class GraphPool:
    def __init__(self, device: torch.device | str, *, enabled: bool | None = None,
                 share_pool: bool = True, eager_runs: int = 2):
        device = torch.device(device)
        self.enabled = device.type == "cuda" if enabled is None else bool(enabled)
        if self.enabled and device.type != "cuda":
            raise ValueError(f"enabled: CUDA graphs need a CUDA device, got {device}")
        self.device, self.eager_runs = device, eager_runs
        self._pool = torch.cuda.graph_pool_handle() if self.enabled and share_pool else None
        self._graphs: dict[Hashable, _Graph] = {}
        self.capture_bytes: dict[Hashable, int] = {}

    @property
    def reserved_bytes(self) -> int:
        return sum(self.capture_bytes.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def static_inputs(self, key: Hashable) -> tuple[torch.Tensor, ...]:
        """The buffers a captured key's inputs are copied into (stable until clear)."""
        return self._graphs[key].inputs

    def clear(self) -> None:
        """Drops every graph (what they read was replaced): the next run of a key captures."""
        self._graphs.clear()
        self.capture_bytes.clear()
        if self.enabled and self._pool is not None:
            self._pool = torch.cuda.graph_pool_handle()

    def run(self, key: Hashable, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        if not self.enabled:
            return fn(*inputs)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key, fn, inputs)
        for static, value in zip(graph.inputs, inputs):
            if static.shape != value.shape or static.dtype != value.dtype:
                raise ValueError(f"inputs: key {key!r} was captured for "
                                 f"{tuple(static.shape)} {static.dtype}, got "
                                 f"{tuple(value.shape)} {value.dtype}")
            static.copy_(value)
        graph.graph.replay()
        return graph.outputs

    def _capture(self, key: Hashable, fn: Callable[..., Any], inputs) -> _Graph:
        static = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # eager runs outside the graph: lazy inits, autotuning
            for _ in range(self.eager_runs):
                fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(*static)
        torch.cuda.synchronize(self.device)
        self.capture_bytes[key] = torch.cuda.memory_reserved(self.device) - before
        return _Graph(graph, static, outputs)
