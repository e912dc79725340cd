import os

import pytest

# Keep the CPU test run predictable on small machines.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test that takes more than a few seconds")
