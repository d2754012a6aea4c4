"""One call at a time, in the order of the streams it was issued on.

A compiled model keeps state between calls that eager PyTorch does not: its CUDA graphs' memcpy
nodes (pointed at each call's inputs just before the replay) or static input buffers, and the
buffers of the outputs it hands out, the same memory at every replay. Two hazards follow, both
silent (another call's numbers, no error):

- **Threads.** Two threads calling one compiled model at once would interleave pointing a graph's
  copy nodes at their inputs and replaying it. The gate's lock makes the calls take turns (a
  reentrant lock: a call may reach a nested compiled model, a specialization, of its own).
- **Streams.** A call issued on another CUDA stream than the previous one (`with
  torch.cuda.stream(s)`, or another thread's current stream) would write the same buffers while the
  previous call's kernels, or the caller's reads of its outputs on that stream, may still run. Eager
  PyTorch is safe there because its caching allocator reuses a block only on the stream that freed
  it. The gate makes the new stream wait for all the work the previous one had enqueued (one event)
  whenever the stream changes; a call on the same stream as the last costs one integer compare.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class CallGate:
    """`with gate:` around a compiled call: the lock, then the stream order (module docstring)."""

    __slots__ = ("lock", "index", "stream", "raw", "stream_waits")

    def __init__(self, device: torch.device) -> None:
        self.lock = threading.RLock()
        self.index: int | None = None
        if device.type == "cuda":
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream: Any = None
        """The torch.cuda.Stream the last call was issued on (None before the first CUDA call)."""
        self.raw = 0
        """Its raw cudaStream_t, compared at every call."""
        self.stream_waits = 0
        """Calls issued on another stream than the call before them (each waited for that stream)."""

    def __enter__(self) -> CallGate:
        self.lock.acquire()
        if self.index is not None:
            try:
                self._order()
            except BaseException:
                self.lock.release()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def _order(self) -> None:
        raw = torch._C._cuda_getCurrentRawStream(self.index)
        if raw == self.raw:
            return
        current = torch.cuda.current_stream(self.index)
        # inside a capture (the caller records our call into a graph of its own) a wait on work
        # outside the capture is illegal; the caller's capture orders its own stream
        if self.stream is not None and not torch.cuda.is_current_stream_capturing():
            current.wait_stream(self.stream)
            self.stream_waits += 1
        self.stream, self.raw = current, raw
