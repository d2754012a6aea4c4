"""CUDA graphs of training graphs through the backend (runtime/replay.py).

Every test trains a model through `torch.compile(backend=streamfuse)` and a deep copy eagerly and
compares losses, gradients and parameters at every step, while the loop does what real loops do
to a replayed graph: the standard zero_grad / forward / backward / step, two forwards before one
backward (saved activations of the first must survive the second), gradient accumulation, results
kept across steps, and a batch tensor that moves. The graphs must replay in the standard loop; in
the others, replays that would overwrite something still visible must not happen.

Each test runs on the GPU (real CUDA graphs) and, on any machine, on the CPU with the graph
emulated (tests/replay_emulation.py): what decides when to record, replay or step, and what is
handed out, copied or rebuilt, is the same code.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from replay_emulation import emulate_replay
from test_training import _assert_match, train_and_compare
from torch import nn

import streamfuse
import streamfuse.capture.backend as backend_module
from streamfuse.bench.runner import exact_fp32
from streamfuse.runtime import pinned as pinned_module
from streamfuse.runtime import replay as replay_module
from streamfuse.runtime.replay import ReplayGraph


@pytest.fixture(params=["cpu-emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    if request.param == "cuda":
        return torch.device("cuda")
    emulate_replay(monkeypatch)
    return torch.device("cpu")


@pytest.fixture
def config(config: streamfuse.Config, device: torch.device) -> streamfuse.Config:
    # on the CPU the reference executor: the emulation tests the replay logic, not the kernels
    return config if device.type == "cuda" else config.replace(executor="reference")


@pytest.fixture(autouse=True)
def _exact_fp32() -> Iterator[None]:
    with exact_fp32():
        yield


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _MLP(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 10)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.ln(self.fc1(x)))))


def _shared(config: streamfuse.Config, device: torch.device) -> streamfuse.Config:
    """The config with the backward recorded into the forward's pool (Config.training_shared_pool)."""
    return config.replace(training_shared_pool=True)


def _replays(first: int) -> dict[str, ReplayGraph]:
    graphs = [g for g in backend_module.compiled_graphs[first:] if isinstance(g, ReplayGraph)]
    return {g.role: g for g in graphs}


def _vision_batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 16, 16, generator=gen).to(device),
             torch.randint(0, 10, (4,), generator=gen).to(device)) for _ in range(n)]


def _ce(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


@pytest.mark.parametrize("shared", [False, True], ids=["separate-pools", "shared-pool"])
@pytest.mark.parametrize("build", [_ConvNet, _MLP], ids=["convnet-batchnorm", "mlp-layernorm"])
def test_standard_loop_replays_forward_and_backward(build: Callable[[], nn.Module], shared: bool,
                                                    config: streamfuse.Config, device: torch.device) -> None:
    config = _shared(config, device) if shared else config.replace(training_shared_pool=False)
    torch.manual_seed(0)
    model = build().to(device)
    first = len(backend_module.compiled_graphs)
    if isinstance(model, _MLP):
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device))
                   for _ in range(10)]
    else:
        batches = _vision_batches(10, device)
    train_and_compare(model, batches, _ce, config)
    graphs = _replays(first)
    assert set(graphs) == {"forward", "backward"}, backend_module.compiled_graphs[first:]
    for role, g in graphs.items():
        assert g.reason is None, g.explain(source=False)
        assert g.replay_stats.replays >= 3, f"{role}: {g.explain(source=False)}"
        assert g.replay_stats.held == 0 and g.replay_stats.moved == 0, g.explain(source=False)
        streams = f"planned for at most {config.training_max_streams} stream(s) (Config.training_max_streams"
        assert streams in g.explain(source=False)
        assert g.compiled.base.schedule.streams <= config.training_max_streams
    if not config.training_shared_pool:
        return
    # the backward was recorded into the forward's pool, taking over the saved activations' memory
    forward, backward = graphs["forward"].graph, graphs["backward"].graph
    assert backward is not None and backward.source is forward and backward.taken, graphs["backward"].explain(False)
    assert forward is not None and forward.sharers == [backward] and not forward.owners
    # the logits the forward copies out: their buffer went back to the pool (emulated: poisoned at
    # every replay of the backward, after the forward copied out of it), and eager's results matched
    assert [o.kind for o in forward.outputs].count("copy") >= 1
    if device.type == "cpu":
        assert forward.released and all(t.isnan().all() for t in forward.released if t.is_floating_point())


def test_a_one_launch_training_graph_replays(config: streamfuse.Config, device: torch.device) -> None:
    """A forward of one kernel (a bias-free Linear: one matrix product) replays its graph too: a
    replay's ~4 µs against a direct launch and the direct path's per-call work (run 173). It used to
    run step by step ("1 launch: nothing for a graph to save")."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16, bias=False).to(device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 32, generator=gen).to(device), torch.randn(8, 16, generator=gen).to(device))
               for _ in range(6)]
    train_and_compare(model, batches, lambda m, x, y: F.mse_loss(m(x), y), config)
    forward = _replays(first)["forward"]
    assert forward.compiled.base.launches == 1, forward.explain(source=False)
    assert forward.reason is None and forward.replay_stats.replays >= 3, forward.explain(source=False)


def test_guards_are_what_keeps_a_shared_pool_right(config: streamfuse.Config, device: torch.device,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation can fail: with the forward's check of the sharing backward's gradients removed,
    a gradient held into the next forward is overwritten (emulated: NaN), which the tests comparing
    against eager would show."""
    if device.type == "cuda":
        pytest.skip("the emulation's overwrite (a real pool's reuse is only sometimes visible)")
    monkeypatch.setattr(replay_module.PinnedGraph, "busy", lambda self: "held" if self.guard.held() else None)
    model, _, compiled = _pair(_MLP, _shared(config, device), device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):  # the standard loop: both graphs record, the backward into the forward's pool
        x, y = torch.randn(8, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device)
        model.zero_grad(set_to_none=True)
        _ce(compiled, x, y).backward()
    assert _replays(first)["backward"].graph.source is not None
    held = model.fc2.weight.grad  # the backward's own buffer, adopted as p.grad
    assert torch.isfinite(held).all()
    compiled(x)  # replays over it, unguarded
    assert not torch.isfinite(held).all()


def test_retain_graph_backward_twice(config: streamfuse.Config, device: torch.device) -> None:
    """backward(retain_graph=True) then a second backward of the same forward: a replay into the
    forward's memory would overwrite the saved activations the second one reads, so a recorded
    backward that took them runs step by step then. (AOTAutograd itself refuses retain_graph where
    it donates buffers to the backward: its config says how to turn that off, as here.)"""
    with torch._functorch.config.patch(donated_buffer=False):
        _retain_graph_twice(_shared(config, device), device)


def _retain_graph_twice(config: streamfuse.Config, device: torch.device) -> None:
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(6)
    for step in range(12):
        x, y = torch.randn(8, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device)
        for m in (compiled, eager):
            for p in (model if m is compiled else eager).parameters():
                p.grad = None
            loss = _ce(m, x, y)
            if step >= 6 and step % 2:  # after the standard loop recorded both graphs, pool shared
                loss.backward(retain_graph=True)
                (2 * loss).backward()
            else:
                loss.backward()
        _compare_params(step, model, eager, grads=True)
    backward = _replays(first)["backward"]
    assert backward.replay_stats.replays > 0, backward.explain(source=False)
    if config.training_shared_pool:
        assert backward.graph is not None and backward.graph.source is not None, backward.explain(source=False)
        assert backward.replay_stats.retained > 0, backward.explain(source=False)


def test_replayed_gradients_are_adopted_not_cloned(config: streamfuse.Config, device: torch.device) -> None:
    """After a replayed backward each p.grad is the graph's gradient buffer itself (autograd adopts
    a gradient no one else references; a clone would cost one more copy of the parameters), and a
    kept p.grad keeps the next backward from replaying over it (accumulation stays right)."""
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device))
               for _ in range(9)]
    for step, (x, y) in enumerate(batches):
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        _ce(compiled, x, y).backward()
        _ce(eager, x, y).backward()
        _compare_params(step, model, eager, grads=True)
    backward = _replays(first)["backward"]
    assert backward.graph is not None and backward.replay_stats.replays >= 3, backward.explain(source=False)
    buffers = {o.value.untyped_storage().data_ptr() for o in backward.graph.outputs if o.kind == "pool"}
    adopted = [name for name, p in model.named_parameters() if p.grad.untyped_storage().data_ptr() in buffers]
    assert adopted == [name for name, _ in model.named_parameters()], (adopted, backward.explain(source=False))
    held = backward.graph.memory()  # what benchmarks/training.py reports: the gradients, once each
    assert held["handed_out"] == sum(p.numel() * p.element_size() for p in model.parameters()), held
    # gradients kept (no zero_grad): the next backward must accumulate into them, not replay over
    # them. Its graph shares the forward's pool, so the forward may not replay over them either: both
    # record again with pools of their own (without the shared pool: a second instance of the
    # backward replays); the new gradients are added into p.grad, which stays where it was
    x, y = batches[0]
    _ce(compiled, x, y).backward()
    _ce(eager, x, y).backward()
    _compare_params(9, model, eager, grads=True)
    if config.training_shared_pool:
        assert any("pool of its own" in h for h in backward.replay_stats.history), backward.explain(source=False)
    else:
        assert backward.spare is not None, backward.explain(source=False)
    assert backward.replay_stats.held == 0, backward.explain(source=False)
    assert all(p.grad.untyped_storage().data_ptr() in buffers for p in model.parameters())


def test_the_incoming_gradient_is_copied_even_when_large(config: streamfuse.Config, device: torch.device) -> None:
    """The backward's incoming gradients (AOTAutograd's tangents) are fresh tensors on most calls, so
    they are copied into the graph whatever their size, never read in place: here one 80 KiB
    gradient tensor is passed for five steps (as the allocator may hand a loss's gradient the same
    block), then a new one each step; read in place, it would move and cost the replays (run 66)."""
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(6)
    same = torch.randn(2048, 10, generator=gen).to(device)
    kept = []
    for step in range(10):
        x = torch.randn(2048, 32, generator=gen).to(device)
        g = same if step < 5 else torch.randn(2048, 10, generator=gen).to(device)
        kept.append(g)  # every later gradient at an address of its own
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        compiled(x).backward(g)
        eager(x).backward(g)
        _compare_params(step, model, eager, grads=True)
    backward = _replays(first)["backward"]
    assert backward.graph is not None, backward.explain(source=False)
    names = [n.name for n in backward.compiled.base.graph.inputs]
    tangents = [i for i, name in enumerate(names) if name.startswith("tangents_")]
    assert tangents and not set(tangents) & set(backward.graph.pinned_at), (names, backward.graph.pinned_at)
    assert backward.replay_stats.moved == 0 and backward.replay_stats.replays >= 3, backward.explain(source=False)
    if device.type == "cuda":
        # the copy lands in the backward graph's own pool, in memory its capture freed after the last
        # reader (not a static buffer of the default pool kept for good: GPT-2's 197 MiB)
        landing = {b.untyped_storage().data_ptr() for b in backward.graph.buffers}
        pools = {seg["address"]: seg for seg in torch.cuda.memory_snapshot()}
        for ptr in landing:
            seg = next(s for a, s in pools.items() if a <= ptr < a + s["total_size"])
            assert tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0), seg


def _sgd_in_lockstep(model: nn.Module, eager: nn.Module, compiled: nn.Module, xs: list[torch.Tensor]) -> None:
    """One SGD step per input on the compiled model and its eager twin; gradients and parameters compared."""
    opt, opt_eager = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    for step, x in enumerate(xs):
        for m, o in ((model, opt), (eager, opt_eager)):
            o.zero_grad(set_to_none=True)
            (m if m is eager else compiled)(x).square().mean().backward()
        _compare_params(step, model, eager, grads=True)
        opt.step()
        opt_eager.step()


def test_small_parameters_are_read_in_place_and_a_small_batch_is_copied(config: streamfuse.Config,
                                                                         device: torch.device) -> None:
    """Parameters of a few hundred bytes (a layer norm's weight and bias, the biases) are read where
    they are, in the forward and in the backward that saved them: only the batch is copied in (each
    copy is a graph node of its own: 192 per GPT-2 step, 539 µs, when they were copied in run 106).
    The batch, 512 bytes at the same address every step, is still copied."""
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(device)
    _sgd_in_lockstep(model, eager, compiled, [x] * 8)
    graphs = _replays(first)
    forward, backward = graphs["forward"], graphs["backward"]
    assert forward.graph is not None and backward.graph is not None, forward.explain(source=False)
    params = {p.data_ptr() for p in model.parameters()}
    for g in (forward, backward):
        names = [n.name for n in g.compiled.base.graph.inputs]
        statics = [i for i, name in enumerate(names) if i in g.static]
        assert statics and set(statics) <= set(g.graph.pinned_at), (g.role, names, g.graph.pinned_at)
    pinned_params = [i for i in forward.graph.pinned_at if i in forward.static]
    assert len(pinned_params) == len(params), (forward.static, forward.graph.pinned_at)
    batch = [i for i in range(len(forward.compiled.base.graph.inputs)) if i not in forward.static]
    assert batch and not set(batch) & set(forward.graph.pinned_at)
    assert forward.replay_stats.replays >= 3 and backward.replay_stats.replays >= 3, forward.explain(source=False)


def test_a_batch_change_keeps_small_parameters_read_in_place(config: streamfuse.Config, device: torch.device) -> None:
    """A partial batch makes Dynamo's graphs symbolic, and their concrete plans are traced again with
    make_fx, which renames the placeholders: the parameters, known by AOTAutograd's names, were then
    found nowhere, and every replay copied each small one in (session 42). They stay read in place."""
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(4)
    _sgd_in_lockstep(model, eager, compiled, [torch.randn(b, 32, generator=gen).to(device) for b in (8, 5, 8, 5, 8, 5)])
    plans = [p for g in backend_module.compiled_graphs[first:] if isinstance(g, backend_module.SymbolicGraph)
             for p in g.plans.values()]
    assert plans and all(isinstance(p, ReplayGraph) for p in plans)
    assert all(len(p.static) >= 2 for p in plans), [(p.role, sorted(p.static)) for p in plans]


def test_each_training_call_draws_once_from_torchs_generator(config: streamfuse.Config,
                                                             device: torch.device) -> None:
    """With dropout and the default Config.seed, each forward call draws its counter base from
    torch's generator exactly once, whether it runs step by step (the first calls) or replays:
    the step-by-step path drew a second time after the replay wrapper's draw, so what the caller's
    torch.rand gave next depended on which path ran."""
    # generated kernels draw the masks (in the interpreter on the CPU): the reference executor's
    # dropout draws on the host, and such a graph never records
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("generated kernels on CPU tensors need Triton's interpreter (set only where no GPU is)")
    _, _, compiled = _pair(lambda: _MLP(dropout=0.3), config.replace(executor="triton"), device)
    first = len(backend_module.compiled_graphs)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(device)
    for step in range(8):
        torch.manual_seed(100 + step)
        compiled(x).sum().backward()
        after = torch.rand(1)
        torch.manual_seed(100 + step)
        torch.randint(0, 2**31 - 1, (1,))  # the one draw (Executable.follow_torch_seed)
        assert torch.equal(after, torch.rand(1)), f"call {step}: not exactly one draw"
    forward = _replays(first)["forward"]
    assert forward.replay_stats.replays >= 2 and forward.replay_stats.step_by_step >= 1, forward.explain(source=False)


def _compare_params(step: int, model: nn.Module, eager: nn.Module, grads: bool) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        if grads:
            _assert_match(f"step {step}: grad of {name}", p.grad, q.grad)
        _assert_match(f"step {step}: parameter {name}", p.detach(), q.detach())


def _compare_and_step(step: int, model: nn.Module, eager: nn.Module, *optimizers: torch.optim.Optimizer) -> None:
    """The end of an accumulation window: gradients and parameters against eager's, then each
    optimizer's step and zero_grad."""
    _compare_params(step, model, eager, grads=True)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad()


def _pair(build: Callable[[], nn.Module], config: streamfuse.Config, device: torch.device
          ) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build().to(device)
    eager = copy.deepcopy(model)
    return model, eager, torch.compile(model, backend=streamfuse.make_backend(config))


def test_two_forwards_before_one_backward(config: streamfuse.Config, device: torch.device) -> None:
    """Micro-batches summed into one loss: the first forward's saved activations are still needed
    when the second runs, so the second must not replay over them."""
    model, eager, compiled = _pair(_ConvNet, config, device)
    first = len(backend_module.compiled_graphs)
    opt_c, opt_e = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager))
    batches = _vision_batches(16, device)
    for step in range(8):
        (x1, y1), (x2, y2) = batches[2 * step], batches[2 * step + 1]
        for m, opt in ((compiled, opt_c), (eager, opt_e)):
            opt.zero_grad()
            (_ce(m, x1, y1) + _ce(m, x2, y2)).backward()
        _compare_params(step, model, eager, grads=True)
        opt_c.step()
        opt_e.step()
    forward = _replays(first)["forward"]
    assert forward.replay_stats.held > 0, forward.explain(source=False)
    assert forward.replay_stats.replays > 0, forward.explain(source=False)


def test_gradient_accumulation_and_kept_results(config: streamfuse.Config, device: torch.device) -> None:
    """zero_grad only every other step (gradients accumulate into .grad), and every step's logits
    kept in a list: none may be overwritten by a later replay."""
    model, eager, compiled = _pair(_MLP, config, device)
    opt_c, opt_e = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager))
    gen = torch.Generator().manual_seed(2)
    kept_c, kept_e = [], []
    for step in range(12):
        x, y = torch.randn(8, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device)
        for m, kept in ((compiled, kept_c), (eager, kept_e)):
            logits = m(x)
            kept.append(logits)
            F.cross_entropy(logits, y).backward()
        if step % 2 == 1:
            _compare_and_step(step, model, eager, opt_c, opt_e)
    for step, (a, b) in enumerate(zip(kept_c, kept_e, strict=True)):
        _assert_match(f"logits of step {step}", a.detach(), b.detach())


@pytest.mark.parametrize("shared", [True, False], ids=["shared-pool", "separate-pools"])
def test_gradient_accumulation_keeps_replaying_the_backward(shared: bool, config: streamfuse.Config,
                                                            device: torch.device) -> None:
    """Four micro-batches per optimizer step: the first backward's gradients become p.grad (adopted)
    and stay held while the next three add into it, so a second instance of the backward's graph
    replays for them instead of running step by step, and every accumulated gradient is eager's."""
    config = _shared(config, device) if shared else config.replace(training_shared_pool=False)
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    opt_c, opt_e = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager))
    gen = torch.Generator().manual_seed(7)
    for step in range(24):
        x, y = torch.randn(8, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device)
        _ce(compiled, x, y).backward()
        _ce(eager, x, y).backward()
        if step % 4 == 3:
            _compare_and_step(step, model, eager, opt_c, opt_e)
    graphs = _replays(first)
    backward, forward = graphs["backward"], graphs["forward"]
    assert backward.spare is not None, backward.explain(source=False)
    stats = backward.replay_stats
    # step by step: the calls before recording, and at most the one that found the first instance held
    # before the second existed; every later call replays one of the two
    assert stats.replays >= 16 and stats.held <= 1, backward.explain(source=False)
    if config.training_shared_pool:
        # the first backward shared the forward's pool; the kept p.grad blocked the next forward,
        # which recorded again with a pool of its own, and the backward followed
        assert any("pool of its own" in h for h in forward.replay_stats.history), forward.explain(source=False)
        assert any("pool of its own" in h for h in stats.history), backward.explain(source=False)
        assert forward.replay_stats.replays >= 16 and forward.replay_stats.held == 0, forward.explain(source=False)


def test_a_batch_that_moves(config: streamfuse.Config, device: torch.device) -> None:
    """The same input tensor (128 KiB: large enough to be read in place) for six steps, then a new
    tensor each step (the graph must notice, run step by step, and record again reading it from a
    copy)."""
    model, eager, compiled = _pair(_MLP, config, device)
    first = len(backend_module.compiled_graphs)
    opt_c, opt_e = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager))
    gen = torch.Generator().manual_seed(3)
    fixed = torch.randn(1024, 32, generator=gen).to(device)
    kept = []
    for step in range(14):
        if step < 6:
            x = fixed.normal_(generator=None)
        else:
            x = torch.randn(1024, 32, generator=gen).to(device)
            kept.append(x)  # all alive: each step's batch is at a new address
        y = torch.randint(0, 10, (1024,), generator=gen).to(device)
        for m, opt in ((compiled, opt_c), (eager, opt_e)):
            opt.zero_grad()
            _ce(m, x, y).backward()
        _compare_params(step, model, eager, grads=True)
        opt_c.step()
        opt_e.step()
    forward = _replays(first)["forward"]
    assert forward.replay_stats.moved > 0, forward.explain(source=False)
    assert any("observed again" in h and "(1: %" in h for h in forward.replay_stats.history), forward.replay_stats.history
    assert forward.replay_stats.recordings >= 2, forward.explain(source=False)


class _Dropped(nn.Module):
    """out = dropout(x * w) with one weight per element: d sum(out) / dw = out / w exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(64, 64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x * self.w, p=0.3, training=True)


def test_dropout_draws_a_fresh_mask_on_every_replay(config: streamfuse.Config, device: torch.device) -> None:
    """Generated kernels read the counter offset from device memory, advanced by every call, replays
    included: each step a new mask, dropping about p of the elements, with the gradient of that mask."""
    if device.type == "cpu":
        if torch.cuda.is_available():
            pytest.skip("generated kernels run on the CPU only in Triton's interpreter (machines without a GPU)")
        config = config.replace(executor="triton")  # the random numbers of generated kernels (interpreter)
    model, _, compiled = _pair(_Dropped, config, device)
    first = len(backend_module.compiled_graphs)
    x = torch.randn(64, 64, device=device)
    masks = []
    for step in range(8):
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.sum().backward()
        kept = out != 0
        masks.append(kept)
        assert 0.6 < kept.float().mean().item() < 0.8, f"step {step}: kept {kept.float().mean().item():.3f}"
        torch.testing.assert_close(out[kept], (x * model.w.detach() / 0.7)[kept], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.w.grad, (kept * x / 0.7), rtol=1e-5, atol=1e-6)
    assert all(not torch.equal(a, b) for a, b in zip(masks, masks[1:])), "a mask repeated"
    forward = _replays(first)["forward"]
    assert forward.reason is None and forward.replay_stats.replays >= 3, forward.explain(source=False)


class _TwoResults(_MLP):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x)
        return y, y.tanh().sum(1)


def test_results_of_a_replayed_forward_can_be_modified_in_place(config: streamfuse.Config, device: torch.device) -> None:
    """The forward's results come out of a replay as tensors of their own (not views of a shared
    buffer), so the caller may change them in place before the backward, as in eager."""
    model, eager, compiled = _pair(_TwoResults, config, device)
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        x = torch.randn(8, 32, generator=gen).to(device)
        for m in (compiled, eager):
            m.zero_grad(set_to_none=True)
            out, rows = m(x)
            rows.add_(1.0)  # in place on a result (not one the backward reads)
            (out.square().mean() + rows.square().mean()).backward()
        _compare_params(step, model, eager, grads=True)
    assert _replays(first)["forward"].replay_stats.replays > 0


@pytest.mark.parametrize("arch", ["bert", "llama", "t5"])
def test_hugging_face_models_train_like_eager_while_replaying(arch: str, config: streamfuse.Config,
                                                              device: torch.device) -> None:
    """Small Hugging Face models (padding masks, SDPA, RoPE and grouped-query attention, relative
    position buckets) trained for eight steps: the steps after the graphs record match eager too."""
    transformers = pytest.importorskip("transformers")
    from test_training import TEXT_ARCHITECTURES, _gen

    torch.manual_seed(5)
    model_class, config_class, sizes = TEXT_ARCHITECTURES[arch]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(vocab_size=128, **sizes))
    model = model.float().train().to(device)
    ids = [torch.randint(1, 128, (2, 12), generator=_gen(60 + i)).to(device) for i in range(8)]
    mask = torch.ones(2, 12, dtype=torch.long, device=device)
    mask[1, 9:] = 0

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(input_ids=x, attention_mask=mask, labels=x).loss  # type: ignore[no-any-return]

    first = len(backend_module.compiled_graphs)
    train_and_compare(model, [(x,) for x in ids], loss, config)
    graphs = _replays(first)
    assert graphs["forward"].replay_stats.replays > 0, graphs["forward"].explain(source=False)
    assert graphs["backward"].replay_stats.replays > 0, graphs["backward"].explain(source=False)


def test_an_output_where_a_taken_input_was_is_the_graphs_own() -> None:
    """On the GPU a backward that took the forward's saved activations over may put a gradient where
    one of them started (its memory was released during the capture): that output is the graph's own
    buffer, not a view of the input rebuilt from the caller's tensor (run 126: rebuilt from a smaller
    activation, it raised; read from one, gradients were wrong)."""
    from types import SimpleNamespace

    gradient = torch.empty(32)
    # the caller's tensor for the taken input: memory owned by no one, where the gradient now lies
    (taken,) = pinned_module.unowned([gradient[:24]])
    parameter = torch.randn(8)
    fake = SimpleNamespace(pinned_at=[0, 1], taken=[0],
                           exe=SimpleNamespace(graph=SimpleNamespace(constants={}), device=torch.device("cpu")))
    kinds = pinned_module.PinnedGraph._classify(fake, [gradient, parameter[2:]], [taken, parameter], set())
    assert [k.kind for k in kinds] == ["pool", "alias"], kinds
    fake.taken = []  # without the exclusion the gradient reads as a view of the input
    assert pinned_module.PinnedGraph._classify(fake, [gradient], [taken, parameter], set())[0].kind == "alias"


def test_the_first_block_of_a_recording() -> None:
    """Config.training_pool_reserve: whole 2 MiB pages of the probed peak, none under 16 MiB; a
    backward recorded into its forward's pool takes only what the forward's block does not hold."""
    size = pinned_module.PinnedGraph._reserve_size
    mib = 2**20
    assert size(15 * mib) == 0 and size(16 * mib) == 16 * mib and size(16 * mib + 1) == 18 * mib
    forward = object.__new__(pinned_module.PinnedGraph)
    forward.reserved, forward.source = 692 * mib, None
    backward = object.__new__(pinned_module.PinnedGraph)
    backward.reserved, backward.source = 706 * mib, forward
    assert forward.first_block() == 692 * mib and backward.first_block() == 14 * mib
    backward.reserved = 600 * mib
    assert backward.first_block() < 0  # the forward's block holds it: no second block
