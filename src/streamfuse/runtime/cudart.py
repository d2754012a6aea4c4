"""The few CUDA runtime calls PyTorch does not expose, through ctypes: a device-to-device copy
captured as a graph node, and the update of that node's source in an instantiated graph.

A captured graph's input copy can live inside the graph (runtime/graphs.py, Config.input_copy_node):
each call points the copy node at the caller's tensor (cudaGraphExecMemcpyNodeSetParams1D) and
replays, instead of issuing a separate cudaMemcpyAsync before the replay.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice
_NODE_TYPE_MEMCPY = 1  # cudaGraphNodeTypeMemcpy


class CudartError(RuntimeError):
    """A CUDA runtime call through ctypes failed, or the runtime library was not found."""


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class _Memcpy3DParms(ctypes.Structure):
    _fields_ = [("srcArray", ctypes.c_void_p), ("srcPos", _Pos), ("srcPtr", _PitchedPtr),
                ("dstArray", ctypes.c_void_p), ("dstPos", _Pos), ("dstPtr", _PitchedPtr),
                ("extent", _Pos), ("kind", ctypes.c_int)]


@cache
def _lib() -> Any:
    """The CUDA runtime this process already loaded (PyTorch's), so that handles are shared."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    except OSError as e:
        raise CudartError(f"cannot read /proc/self/maps: {e}") from e
    if not paths:
        raise CudartError("the CUDA runtime library (libcudart) is not loaded in this process")
    lib = ctypes.CDLL(paths[0])
    p, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, args in (("cudaMemcpyAsync", [p, p, size, i, p]),
                       ("cudaGraphGetNodes", [p, ctypes.POINTER(p), ctypes.POINTER(size)]),
                       ("cudaGraphNodeGetType", [p, ctypes.POINTER(i)]),
                       ("cudaGraphMemcpyNodeGetParams", [p, ctypes.POINTER(_Memcpy3DParms)]),
                       ("cudaGraphExecMemcpyNodeSetParams1D", [p, p, p, p, size, i])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = [i], ctypes.c_char_p
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise CudartError(f"{what} failed: {_lib().cudaGetErrorString(code).decode()} ({code})")


def available() -> bool:
    try:
        _lib()
    except (CudartError, OSError, AttributeError):
        return False
    return True


def memcpy_d2d_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cudaMemcpyAsync device to device on `stream` (a raw cudaStream_t): under stream capture it
    becomes a memcpy node of the graph."""
    _check(_lib().cudaMemcpyAsync(dst, src, nbytes, _DEVICE_TO_DEVICE, stream), "cudaMemcpyAsync")


def memcpy_nodes(graph: int) -> dict[int, int]:
    """Destination address -> node, for the 1-D memcpy nodes of a cudaGraph_t."""
    lib = _lib()
    count = ctypes.c_size_t(0)
    _check(lib.cudaGraphGetNodes(graph, None, ctypes.byref(count)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cudaGraphGetNodes(graph, nodes, ctypes.byref(count)), "cudaGraphGetNodes")
    found: dict[int, int] = {}
    for node in nodes[: count.value]:
        kind = ctypes.c_int(-1)
        _check(lib.cudaGraphNodeGetType(node, ctypes.byref(kind)), "cudaGraphNodeGetType")
        if kind.value != _NODE_TYPE_MEMCPY:
            continue
        params = _Memcpy3DParms()
        _check(lib.cudaGraphMemcpyNodeGetParams(node, ctypes.byref(params)), "cudaGraphMemcpyNodeGetParams")
        if params.dstPtr.ptr and params.extent.y <= 1 and params.extent.z <= 1:
            found[params.dstPtr.ptr] = node
    return found


def set_memcpy_source(graph_exec: int, node: int, dst: int, src: int, nbytes: int) -> None:
    """Point an instantiated graph's 1-D device-to-device memcpy node at `src` (`nbytes` bytes)."""
    _check(_lib().cudaGraphExecMemcpyNodeSetParams1D(graph_exec, node, dst, src, nbytes, _DEVICE_TO_DEVICE),
           "cudaGraphExecMemcpyNodeSetParams1D")
