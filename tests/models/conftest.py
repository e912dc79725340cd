"""Model-test fixtures and the parity summary line."""

from __future__ import annotations

import pytest
from model_builders import CASES, LARGEST_ERRORS


@pytest.fixture(params=sorted(CASES))
def case(request) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["torch-ops", "fused-kernels"])
def fused(request) -> bool:
    """The model's norms, rotary embeddings and MLP activation as torch ops, or ember's CPU kernels."""
    return request.param


def pytest_terminal_summary(terminalreporter) -> None:
    if LARGEST_ERRORS:
        label, error = max(LARGEST_ERRORS.items(), key=lambda item: item[1])
        terminalreporter.write_line(
            f"model parity: largest logits error / max |logit| = {error:.2e} ({label}); "
            + ", ".join(f"{k} {v:.1e}" for k, v in sorted(LARGEST_ERRORS.items())))
