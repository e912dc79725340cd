import os
import shutil
import tempfile

# Tokenizers may not fork-spawn threads in the server subprocesses the end-to-end tests start.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Servers and apps keep their state (the Responses store) in a scratch folder, never the home folder.
STATE_DIR = tempfile.mkdtemp(prefix="ember-test-state-")
os.environ["EMBER_STATE_DIR"] = STATE_DIR


def pytest_unconfigure(config):
    shutil.rmtree(STATE_DIR, ignore_errors=True)
