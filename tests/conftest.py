import os

# Tokenizers may not fork-spawn threads in the server subprocesses the end-to-end tests start.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
