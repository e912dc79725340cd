r"""`ember bench` with the KV manager's RUN_ROOM set, to hold one room against another.

    python bench/run_room.py ROOM bench --offline --no-limits --seed N --concurrency 32 \
        --input-len 128 --output-len 512 --num-requests 32

ROOM 1 is the allocation before runs were given room (a new run starts at the queue's front);
ember's own is KVCacheManager.RUN_ROOM. Run the rooms in turn, a new --seed each round (one seed
twice in a process would find its prompts in the prefix cache).
"""

from __future__ import annotations

import sys

from ember.cli import main
from ember.engine.kv_cache import KVCacheManager

if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
        raise SystemExit(__doc__)
    KVCacheManager.RUN_ROOM = int(sys.argv[1])
    sys.argv = ["ember", *sys.argv[2:]]
    sys.exit(main())
