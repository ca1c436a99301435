"""The one dispatch point: CuPy raw kernels for CUDA tensors, the torch reference otherwise.

The GPU path is taken when every tensor argument lives on a CUDA device and CuPy is usable;
``KVCM_KERNELS=reference`` forces the reference (benchmarks use it to time torch ops on the
GPU). Kernels launch on torch's current stream of the tensors' device, so they order with the
torch work around them. Each ``.cu`` file is compiled once per process and device by
``cupy.RawModule`` (and cached on disk by CuPy across processes, in ``CUPY_CACHE_DIR`` or
``~/.cupy/kernel_cache``).

CuPy that is installed but unusable (its import creates that cache directory and raises
``PermissionError`` when ``$HOME`` is not writable; no driver; no NVRTC) is not an error: the
references run instead, after one warning on this module's logger that names the cause.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).parent
log = logging.getLogger(__name__)

#: Compiled once when CuPy is first asked for: it needs what every launch needs (the driver,
#: NVRTC, CuPy's kernel cache), so an unusable CuPy shows here, where the references can
#: still take over, rather than at the first launch of a step.
PROBE_SOURCE = 'extern "C" __global__ void kvcm_probe(int* out) { if (out) *out = 0; }'


@functools.cache
def _cupy() -> Any:
    """CuPy, or None when the torch references must run (decided once per process).

    Asked only once CUDA tensors are about. Not installed is the CPU install's normal case;
    installed but failing to import or to compile the probe kernel is logged once as a
    warning with the exception, so that a GPU deployment that runs the slower references
    says why instead of raising in the middle of a step.
    """
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            log.info("CuPy is not installed (the gpu extra): kvcm_kernels runs the references")
        else:  # CuPy is there, something it imports is not
            _warn_unusable(exc)
        return None
    except Exception as exc:  # e.g. PermissionError creating its kernel cache under $HOME
        _warn_unusable(exc)
        return None
    try:
        cupy.cuda.runtime.getDeviceCount()
        cupy.RawModule(code=PROBE_SOURCE).get_function("kvcm_probe")
    except Exception as exc:
        _warn_unusable(exc)
        return None
    return cupy


def _warn_unusable(exc: BaseException) -> None:
    # An OSError is nearly always CuPy's kernel cache (~/.cupy/kernel_cache by default).
    hint = (
        " Set CUPY_CACHE_DIR (or HOME) to a directory this user can write."
        if isinstance(exc, OSError)
        else ""
    )
    log.warning(
        "CuPy is installed but unusable (%s: %s): kvcm_kernels falls back to the torch "
        "reference kernels, which are slower on the GPU.%s",
        type(exc).__name__,
        exc,
        hint,
    )


def gpu_path(*tensors: torch.Tensor) -> bool:
    if os.environ.get("KVCM_KERNELS") == "reference":
        return False
    return all(t.is_cuda for t in tensors) and _cupy() is not None


def gpu_path_pinned_inputs(device_tensor: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """GPU path for a kernel that may read its small inputs straight from pinned host memory.

    Under unified addressing, memory from cudaHostAlloc (torch's pinned memory) is readable by
    the device at its host address, so a step's inputs need no copy of their own.
    """
    return gpu_path(device_tensor) and all(t.is_cuda or t.is_pinned() for t in inputs)


@functools.cache
def _module(name: str) -> Any:
    cupy = _cupy()
    return cupy.RawModule(code=(HERE / f"{name}.cu").read_text(), options=("-std=c++17",))


@functools.cache
def _function(module: str, function: str, device: int) -> Any:
    with _cupy().cuda.Device(device):
        return _module(module).get_function(function)


@functools.cache
def _stream(pointer: int, device: int) -> Any:
    # CuPy 14 deprecates ExternalStream for Stream.from_external; both wrap the same handle,
    # and ExternalStream also exists in CuPy 12 and 13.
    with _cupy().cuda.Device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _cupy().cuda.ExternalStream(pointer, device)


def current_stream_handle(index: int) -> int:
    """The raw handle of torch's current stream on device ``index`` (0: the default
    stream). torch's raw accessor costs about 0.1 us, ``current_stream(index).cuda_stream``
    about 3, and a step asks once per rank and per host-tier copy."""
    # torch has no public raw accessor: the private one is what it uses itself.
    return int(torch._C._cuda_getCurrentRawStream(index))  # noqa: SLF001


def launch(
    module: str,
    function: str,
    device: torch.device,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    shared_mem: int = 0,
    stream_handle: int | None = None,
) -> None:
    """Launch ``function`` of ``module.cu`` on torch's current stream of ``device`` (or on
    the stream whose raw handle is ``stream_handle``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if stream_handle is None:
        stream_handle = current_stream_handle(index)
    stream = _stream(stream_handle, index)
    with _cupy().cuda.Device(index), stream:
        _function(module, function, index)(grid, block, args, shared_mem=shared_mem)


def ptr(t: torch.Tensor) -> np.uint64:
    """A device pointer as a kernel argument (8 bytes, like the pointer parameter)."""
    return np.uint64(t.data_ptr())


def i32(value: int) -> np.int32:
    return np.int32(value)


def i64(value: int) -> np.int64:
    return np.int64(value)


def blocks(n: int, threads: int, limit: int = 65535 * 16) -> int:
    return max(1, min(-(-n // threads), limit))
