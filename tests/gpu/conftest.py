"""Every test in this folder runs on a CUDA GPU: it is marked `gpu` (`pytest -m gpu` selects them,
`-m "not gpu"` leaves them out) and skipped where torch sees no CUDA device, as on CI.
scripts/gpu_check.sh runs them on a lent machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_FOLDER = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if _FOLDER in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
