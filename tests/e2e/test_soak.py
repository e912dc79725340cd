"""The soak's short form (bench/soak.py runs the long one): about a thousand requests across Chat,
Completions, Responses, Messages and /generate, streamed and not, with structured outputs and tools,
on the shared server, while 10% of the clients disconnect mid-stream, 5% read slowly and 2% send
hostile bodies. Afterwards nothing is held: no KV block, no running request, no extra descriptor or
thread in the server or its worker, resident memory within 5% of its value after the warm-up, and
no request failed that nobody provoked. (The flooding tenant needs an API key file: it is the long
form's, and tests/e2e/test_tenants.py checks a flood's 429s.) Latencies are reported, not asserted."""

from __future__ import annotations

from ember.bench.soak import run_soak


def test_a_thousand_requests_with_misbehaving_clients_leave_nothing_held(server, model_id):
    report = run_soak(server.url, server.proc.pid, "unused", None, model_id, 1000, concurrency=16, max_tokens=4)
    summary = report.summary()
    print(summary)
    assert report.mixed.faults["disconnect"] > 0 and report.mixed.faults["hostile"] > 0, summary
    assert report.problems == [], summary
    assert sum(count for (kind, _), count in report.mixed.statuses.items() if kind == "chat") > 0
