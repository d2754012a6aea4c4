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
