"""A compiled model called from several threads, or on several CUDA streams (runtime/gate.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import streamfuse
from streamfuse import Config
from streamfuse.capture.backend import compiled_graphs

THREADS, CALLS = 4, 3


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8)).eval()


class _Overlap:
    """Wraps a call: counts how many run at once (each holds on for 2 ms, so unguarded calls overlap)."""

    def __init__(self, call: Callable[..., Any]):
        self.call, self.active, self.most = call, 0, 0
        self.lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            time.sleep(0.002)
            return self.call(*args)
        finally:
            with self.lock:
                self.active -= 1


def _from_threads(model: Callable[..., Any], eager: torch.nn.Module) -> list[str]:
    """Calls `model` from THREADS threads, each with inputs of its own; returns what went wrong."""
    wrong: list[str] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for call in range(CALLS):
            x = torch.randn(4, 16, generator=gen)
            try:
                with torch.no_grad():
                    got, want = model(x), eager(x)
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                    wrong.append(f"thread {seed}, call {call}: off by {(got - want).abs().max().item():.2e}")
            except Exception as exc:  # noqa: BLE001 - reported by the test
                wrong.append(f"thread {seed}, call {call}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong


def test_streamfuse_compile_calls_from_threads_take_turns(config: Config) -> None:
    model = _mlp()
    compiled = streamfuse.compile(model, (torch.randn(4, 16),), config=config)
    with torch.no_grad():
        compiled(torch.randn(4, 16))  # the first call (kernels compiled) before the threads
    overlap = _Overlap(compiled._entry)
    compiled._entry = overlap  # what the gate guards: the whole call
    assert _from_threads(compiled, model) == []
    assert overlap.most == 1, f"{overlap.most} calls of one compiled model ran at once"


def test_backend_calls_from_threads_take_turns(config: Config) -> None:
    model = _mlp()
    torch._dynamo.reset()
    before = len(compiled_graphs)
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        compiled(torch.randn(4, 16))
    graphs = compiled_graphs[before:]
    assert len(graphs) == 1
    overlap = _Overlap(graphs[0].run_flat)
    graphs[0].run_flat = overlap  # what the backend's gate guards: the graph's call
    assert _from_threads(compiled, model) == []
    assert overlap.most == 1, f"{overlap.most} calls of one compiled graph ran at once"


@pytest.mark.gpu
def test_a_call_on_another_stream_waits_for_the_last_one(config: Config) -> None:
    """The second call's stream waits for the first's: its graph's buffers are the same memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().eval()
    x1, x2 = torch.randn(64, 1024, device="cuda"), torch.randn(64, 1024, device="cuda")
    compiled = streamfuse.compile(model, (x1,), config=config)
    with torch.no_grad():
        compiled(x1)
        compiled(x1)  # recorded
        want1, want2 = model(x1), model(x2)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            torch.cuda._sleep(20_000_000)  # s1 busy for a while: the call after it is still queued
            first = compiled(x1).clone()  # the clone on s1 reads the graph's output buffer
        with torch.cuda.stream(s2):
            second = compiled(x2).clone()
        torch.cuda.synchronize()
    assert compiled.gate.stream_waits >= 1
    torch.testing.assert_close(first, want1, rtol=1e-2, atol=1e-2)  # TF32 either side
    torch.testing.assert_close(second, want2, rtol=1e-2, atol=1e-2)
