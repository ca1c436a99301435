from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvcm import native


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def restore_native() -> Iterator[None]:
    """Put the C core back as it was (on, or off with KVCM_NATIVE=0) after a test that
    switches it (``native.use``, or a spy in ``native.core``)."""
    on = native.core is not None
    yield
    native.use(on)
