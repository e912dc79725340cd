"""`ember bench`: a client-side serving benchmark for ember and any OpenAI-compatible server.

    from ember.bench import BenchConfig, format_report, run
    result = run(BenchConfig(base_url="http://127.0.0.1:8000", concurrency=[1, 4]))
    print(format_report(result))

Modules: config (settings, levels), words and workload (seeded prompts, conversations), records
(one request's numbers), http_client and offline (where requests go), loops (closed, open,
multiturn; limits), runner (a whole run), stats (summaries), result (JSON), report (text), plot,
progress, cli; limits (the machine's bounds) and machine_probe (measuring them, offline).
"""

from ember.bench.config import BenchConfig, BenchError, LengthRange, OfflineSettings
from ember.bench.report import format_report
from ember.bench.result import BenchResult
from ember.bench.runner import run

__all__ = ["BenchConfig", "BenchError", "BenchResult", "LengthRange", "OfflineSettings", "format_report", "run"]
