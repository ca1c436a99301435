"""An installed but unusable CuPy: the kernels fall back and say why, CUDA sharing refuses.

The image's user once had no writable home, and CuPy's import creates its kernel cache there
(``~/.cupy/kernel_cache``): ``import cupy`` raised ``PermissionError``, which the kernels and
the CUDA share path did not expect (they caught ``ImportError`` only). These tests put a fake
``cupy`` package on ``sys.path`` whose import (or first use) fails the way the real one does,
since this machine has neither CuPy nor a GPU.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvcm.shared_memory import CudaSegments
from kvcm.tier_copies import TierCopier
from kvcm_client.errors import DeviceUnavailable
from kvcm_client.shared import _device_with_uuid
from kvcm_kernels import _dispatch, block_copy

#: What CuPy 14's import raises as a user whose $HOME it cannot create (seen in the image).
RAISES_ON_IMPORT = (
    "raise PermissionError(13, 'Permission denied', '/home/kvcm')\n"  # os.makedirs's own error
)

#: Imports, but the driver is older than its CUDA runtime (no GPU usable by it).
RAISES_ON_FIRST_USE = """
class _Runtime:
    @staticmethod
    def getDeviceCount():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

cuda = type("cuda", (), {"runtime": _Runtime})
"""

#: Imports and compiles: what the probe needs of a working CuPy.
WORKS = """
compiled = []

class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

cuda = type("cuda", (), {"runtime": _Runtime})

class RawModule:
    def __init__(self, code, options=()):
        self.code = code

    def get_function(self, name):
        compiled.append(name)
        return object()
"""


Install = Callable[[str], None]


@pytest.fixture
def fake_cupy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """Install a ``cupy`` package with the given source; undone after the test (the module,
    and the kernels' cached decision)."""

    def install(source: str) -> None:
        package = tmp_path / "fake" / "cupy"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(source)
        monkeypatch.syspath_prepend(str(package.parent))

    saved = sys.modules.pop("cupy", None)
    _dispatch._cupy.cache_clear()
    try:
        yield install
    finally:
        sys.modules.pop("cupy", None)
        if saved is not None:
            sys.modules["cupy"] = saved
        _dispatch._cupy.cache_clear()


CUDA_TENSOR = SimpleNamespace(is_cuda=True)  # all gpu_path asks of a tensor


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelname == "WARNING"]


def test_kernels_fall_back_with_one_warning_when_cupy_import_raises(
    fake_cupy: Install, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cupy(RAISES_ON_IMPORT)
    with caplog.at_level(logging.INFO):
        assert _dispatch.gpu_path(CUDA_TENSOR) is False  # the torch reference runs
        assert _dispatch.gpu_path(CUDA_TENSOR) is False
        assert block_copy.cuda_runtime() is None  # torch's events, not CuPy's raw ones
    (message,) = _warnings(caplog, "kvcm_kernels._dispatch")  # once, not per call
    assert "CuPy is installed but unusable" in message
    assert "PermissionError" in message and "/home/kvcm" in message
    assert "torch reference kernels" in message
    assert "CUPY_CACHE_DIR" in message  # what to do about it


def test_kernels_fall_back_when_cupy_imports_but_cannot_run(
    fake_cupy: Install, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cupy(RAISES_ON_FIRST_USE)
    with caplog.at_level(logging.WARNING):
        assert _dispatch.gpu_path(CUDA_TENSOR) is False
    (message,) = _warnings(caplog, "kvcm_kernels._dispatch")
    assert "cudaErrorInsufficientDriver" in message and "RuntimeError" in message
    assert "CUPY_CACHE_DIR" not in message  # not a cache problem: no misleading hint


def test_a_working_cupy_takes_the_gpu_path_after_compiling_the_probe(
    fake_cupy: Install, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cupy(WORKS)
    with caplog.at_level(logging.WARNING):
        assert _dispatch.gpu_path(CUDA_TENSOR) is True
        assert _dispatch.gpu_path(torch.zeros(1)) is False  # a CPU tensor: the reference
    assert sys.modules["cupy"].compiled == ["kvcm_probe"]  # type: ignore[attr-defined]
    assert not _warnings(caplog, "kvcm_kernels._dispatch")


def test_no_cupy_is_the_quiet_reference_path(
    fake_cupy: Install, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy: ModuleNotFoundError
    with caplog.at_level(logging.WARNING):
        assert _dispatch.gpu_path(CUDA_TENSOR) is False
    assert not _warnings(caplog, "kvcm_kernels._dispatch")


def test_sharing_cuda_pools_refuses_with_a_typed_error_naming_cupy(
    fake_cupy: Install, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cupy(RAISES_ON_IMPORT)
    with caplog.at_level(logging.WARNING), pytest.raises(DeviceUnavailable) as info:
        CudaSegments("gen", torch.device("cuda:0"))
    message = str(info.value)
    assert "CuPy" in message and "PermissionError" in message and "CUPY_CACHE_DIR" in message
    assert info.value.code == "device_unavailable"
    assert any("CuPy" in m for m in _warnings(caplog, "kvcm"))  # in the sidecar's log too


def test_sharing_cuda_pools_without_cupy_still_says_install_the_gpu_extra(
    fake_cupy: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(DeviceUnavailable, match=r"needs CuPy \(the gpu extra\)"):
        CudaSegments("gen", torch.device("cuda:0"))


def test_mapping_cuda_pools_in_the_consumer_refuses_with_a_typed_error(
    fake_cupy: Install, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cupy(RAISES_ON_IMPORT)
    with caplog.at_level(logging.WARNING), pytest.raises(DeviceUnavailable) as info:
        _device_with_uuid("00" * 16)  # the first CuPy call of attaching a CUDA pool
    assert "CuPy" in str(info.value) and "PermissionError" in str(info.value)
    assert _warnings(caplog, "kvcm_client.shared")


def test_a_host_tier_on_cuda_refuses_with_a_typed_error_naming_cupy(
    fake_cupy: Install, caplog: pytest.LogCaptureFixture
) -> None:
    """The host tier's copies are CuPy kernels and raw CUDA calls: without a usable CuPy it
    is refused where it is built, not with an ``AttributeError`` in the first step's copy."""
    fake_cupy(RAISES_ON_IMPORT)
    pool = torch.zeros(4, 64, dtype=torch.uint8)  # (the device is the copier's to check)
    with caplog.at_level(logging.WARNING), pytest.raises(DeviceUnavailable) as info:
        TierCopier([pool], {0: [pool.clone()]}, {0: [0]}, torch.device("cuda:0"))
    assert "needs CuPy" in str(info.value) and info.value.detail == {"device": "cuda:0"}
    assert _warnings(caplog, "kvcm_kernels._dispatch")  # and the log says why
