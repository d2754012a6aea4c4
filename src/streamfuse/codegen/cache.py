"""Compile-once cache for generated kernels, keyed by the content hash in their name.

Triton's @jit reads a kernel's source back from its file, so each kernel is written to
`<cache_dir>/kernels/<fn_name>.py` (fn_name carries the hash of the source) and imported from
there. Triton's own cache then keys the compiled binary on that source.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

_loaded: dict[str, Any] = {}
_lock = threading.Lock()


def load_kernel(fn_name: str, source: str, cache_dir: Path) -> Any:
    """The @triton.jit function `fn_name` defined by `source` (written to disk once)."""
    with _lock:
        if fn_name in _loaded:
            return _loaded[fn_name]
        folder = Path(cache_dir) / "kernels"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{fn_name}.py"
        if not path.exists() or path.read_text() != source:
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"streamfuse_kernels.{fn_name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kernel = getattr(module, fn_name)
        _loaded[fn_name] = kernel
        return kernel


def compile_ahead(jobs: list[tuple[Any, list[Any], tuple[int, ...], dict[str, Any]]], device: Any,
                  threads: int) -> list[str | None]:
    """Compile kernels before their first launch, on up to `threads` threads: each job is
    (@triton.jit function, launch arguments, grid, launch options and constexprs), the arguments as
    real tensors or as torch dtypes standing for 16-byte-aligned tensors (Triton's MockTensor). The
    compiled binaries land in the functions' own caches, so the launches with the same
    specialization find them, with their launchers built and modules loaded. Returns, per job, None or why it did not compile (its launch will
    raise or compile again, as without this)."""
    import torch

    def one(job: tuple[Any, list[Any], tuple[int, ...], dict[str, Any]]) -> str | None:
        kernel, args, grid, options = job
        try:
            with torch.cuda.device(device):
                compiled = kernel.warmup(*args, grid=grid, **options)
                # the launcher stub and the module load otherwise happen at the first launch, one
                # kernel after another (densenet121's cold first call: 10.6 s after 0 recompiles)
                init = getattr(compiled, "_init_handles", None)
                if init is not None:
                    init()
        except Exception as exc:  # noqa: BLE001 - reported; the launch path handles the failure
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        return None

    if threads <= 1 or len(jobs) <= 1:
        return [one(j) for j in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(threads, len(jobs))) as pool:
        return list(pool.map(one, jobs))
