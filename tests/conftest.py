"""Test set-up: without CUDA, generated kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, hence at the top of conftest.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from streamfuse import Config


def pytest_configure(config: pytest.Config) -> None:
    # a fallback to eager hides a failure of the plan behind right answers: in tests it is an error
    # (tests of the fallback itself expect the warning with pytest.warns). Added here, not in
    # pyproject.toml: resolving the class imports triton, which must follow TRITON_INTERPRET above.
    config.addinivalue_line("filterwarnings", "error::streamfuse.runtime.fallback.StreamfuseFallbackWarning")


@pytest.fixture(scope="session")
def config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    # no tile tuning on the GPU unless a test asks for it (tests/test_tune.py, test_matmul.py): the
    # heuristic tile is what the interpreter runs too, and tuning every test's products takes minutes
    return Config(cache_dir=tmp_path_factory.mktemp("streamfuse-cache"), autotune=False)


@pytest.fixture(params=["reference", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="these models are on the CPU: generated kernels run there only in Triton's interpreter"))])
def train_config(request: pytest.FixtureRequest, config: Config) -> Config:
    """Both executors for the CPU training tests: the generated kernels (Triton's interpreter) and
    torch per group."""
    return config.replace(executor=request.param)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-examples", type=int, default=None,
                     help="programs per family for tests/test_fuzz.py (the long profile; default: the CI budget)")


@pytest.fixture
def tf32_flags():  # type: ignore[no-untyped-def]
    """set_flags(matmuls, convolutions): TF32 permission for the test; both flags restored after (they
    are properties of torch's modules: monkeypatch cannot restore them)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32

    def set_flags(matmuls: bool, convolutions: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmuls, convolutions

    yield set_flags
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewrites over weights (ir/pad_mm, ir/merge_mm) take CUDA weights only: CPU weights too, so
    the CPU can check their plans."""
    from streamfuse.ir import pad_mm

    monkeypatch.setattr(pad_mm, "DEVICES", ("cuda", "cpu"))


@pytest.fixture
def ieee_products():  # type: ignore[no-untyped-def]
    """TF32 off for the test (products compared with eager's at float32's tolerance)."""
    from streamfuse.bench.runner import exact_fp32

    with exact_fp32():
        yield
