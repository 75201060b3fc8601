"""CUDA-graph replay of device segments.

A device segment is a maximal run of instructions that only touch one GPU (delegates and
copies), ended by a host instruction or a copy between GPUs. Every address in it is fixed
(planned memory, or the fixed tensors device inputs are staged into), so after one eager
warm-up call the segment is captured once and replayed on every later call. A segment that
reads per-call host tensors, or whose capture fails, runs eagerly with a warning: never a
wrong result.
"""

from __future__ import annotations

import warnings

import torch


class GraphSegment:
    def __init__(self, steps, device_index: int, streams, touches_host: bool, label: str):
        self.steps = steps
        self.index = device_index
        self.streams = streams
        self.touches_host = touches_host
        self.label = label
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key = None
        self.failed = False

    def _eager(self):
        for s in self.steps:
            s()

    def __call__(self, key=None):
        if self.failed:
            return self._eager()
        if self.graph is not None:
            if key != self.key:
                warnings.warn(f"{self.label}: input shapes changed since capture; running without the CUDA graph",
                              RuntimeWarning, stacklevel=3)
                return self._eager()
            self.graph.replay()
            if self.touches_host:
                self.streams.note_host_dependency(("graph", id(self)), self.index)
            return None
        self.calls += 1
        if self.calls == 1:
            return self._eager()  # warm-up: lazy initialisation (cuBLAS handles, ...) stays out of the graph
        return self._capture(key)

    def _capture(self, key):
        g = torch.cuda.CUDAGraph()
        self.streams.wait_host()
        self.streams.capturing = True
        failure = None
        try:
            # a capture stream on this segment's GPU: torch.cuda.graph's default is one stream
            # made on whichever device was current at its first use, which records nothing for
            # work on another GPU (an empty graph that replays as a no-op)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.device(self.index), torch.cuda.graph(g, stream=self.streams.capture_stream(self.index)):
                    self._eager()
            for w in caught:
                if "Graph is empty" in str(w.message):  # its work went to another stream or GPU
                    raise RuntimeError("the captured graph is empty")
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        except Exception as e:  # an op that cannot be captured (host sync, pageable copy, ...)
            failure = e
        finally:
            self.streams.capturing = False  # before any eager run: its copies need their events
        if failure is not None:
            self.failed = True
            warnings.warn(f"{self.label}: CUDA-graph capture failed ({type(failure).__name__}: {failure}); "
                          "running it eagerly from now on", RuntimeWarning, stacklevel=3)
            torch.cuda.synchronize(self.index)
            return self._eager()
        self.graph, self.key = g, key
        g.replay()
        if self.touches_host:
            self.streams.note_host_dependency(("graph", id(self)), self.index)
        return None
