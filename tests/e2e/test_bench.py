"""`ember bench` against a live `ember serve`, against a small HTTP server that fails on purpose, and offline.

No assertion here is about speed: only that the numbers exist, agree with the server's usage and
with each other, and that failures, time limits and Ctrl-C end cleanly.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import wait_idle
from ember.bench import BenchConfig, LengthRange, OfflineSettings, format_report, run
from ember.bench.config import BenchError, Level
from ember.bench.loops import poisson_arrivals
from ember.bench.records import RequestRecord
from ember.bench.stats import Distribution, percentile, summarize
from ember.bench.workload import Calibration, conversations, single_requests

# Each run also sends two one-token calibration requests and a four-token warm-up.
SETUP_OUTPUT_TOKENS = 2 * 1 + 4


def bench_command() -> list[str]:
    return [sys.executable, "-m", "ember.cli", "bench"]


def check_level(level, *, output_len: int, http: bool = True) -> None:
    """Sane, self-consistent numbers for a level where every request succeeded."""
    s = level.summary
    assert s.num_sent == len(level.records) > 0 and s.num_ok == s.num_sent and not s.errors
    assert level.stopped_by is None and s.num_missing_usage == 0
    for record in level.records:
        assert record.ok and record.status == (200 if http else None)
        assert record.completion_tokens == output_len  # ignore_eos holds the length; usage reports it
        assert 0 < record.prompt_tokens and 1 <= len(record.chunk_times) <= record.completion_tokens
        assert record.sent < record.first_token <= record.chunk_times[-1] <= record.ended
        assert record.chunk_times == sorted(record.chunk_times)
    assert s.output_tokens == sum(r.completion_tokens for r in level.records)
    assert s.prompt_tokens == sum(r.prompt_tokens for r in level.records)
    assert s.wall_s == max(r.ended for r in level.records) > 0
    assert s.output_tokens_per_s == pytest.approx(s.output_tokens / s.wall_s)
    assert s.requests_per_s == pytest.approx(s.num_ok / s.wall_s)
    for dist in (s.ttft, s.itl, s.tpot, s.e2e, s.request_output_tokens_per_s):
        assert dist is not None and 0 < dist.min <= dist.p50 <= dist.p90 <= dist.p99 <= dist.max
        assert dist.min <= dist.mean <= dist.max
    assert s.ttft.max <= s.e2e.max


# ---- pure parts -----------------------------------------------------------------------------------


def test_lengths_parse_fixed_and_ranged():
    assert LengthRange.parse("128") == LengthRange(128, 128) and str(LengthRange.parse("64:256")) == "64:256"
    rng = random.Random(0)
    assert all(64 <= LengthRange(64, 256).sample(rng) <= 256 for _ in range(100))
    for bad in ("0", "9:3", "x", "4:y"):
        with pytest.raises(BenchError):
            LengthRange.parse(bad)
    with pytest.raises(BenchError):
        BenchConfig(base_url="http://x", workload="multiturn", request_rates=[1.0])
    with pytest.raises(BenchError):
        BenchConfig()  # neither a server nor --offline


def test_prompts_lengths_and_arrivals_are_the_same_for_the_same_seed():
    config = BenchConfig(base_url="http://x", input_len="20:60", output_len="5:9", num_requests=8, seed=7)
    calibration = Calibration(tokens_per_word=1.25, overhead_tokens=10)
    first = single_requests(config, calibration, 0, Level(concurrency=2))
    assert first == single_requests(config, calibration, 0, Level(concurrency=2))
    assert len({spec.prompt[0]["content"] for spec in first}) == len(first)  # no two prompts alike
    other_level = single_requests(config, calibration, 1, Level(concurrency=2))
    assert not {s.prompt[0]["content"] for s in first} & {s.prompt[0]["content"] for s in other_level}
    other_seed = single_requests(BenchConfig(base_url="http://x", seed=8, num_requests=8), calibration, 0,
                                 Level(concurrency=2))
    assert first[0].prompt != other_seed[0].prompt
    for spec in first:
        assert 20 <= spec.input_len <= 60 and 5 <= spec.output_len <= 9
        assert len(spec.prompt[0]["content"].split()) == calibration.words_for(spec.input_len)
    assert poisson_arrivals(5, 2.0, random.Random(3)) == poisson_arrivals(5, 2.0, random.Random(3))


def test_a_conversation_grows_by_the_reply_and_a_new_message():
    config = BenchConfig(base_url="http://x", workload="multiturn", input_len=12, output_len=4, turns=3)
    conversation = conversations(config, Calibration(1.0, 0.0), 0, Level(concurrency=1))[0]
    first = conversation.next_request()
    conversation.add_reply("a reply")
    second = conversation.next_request()
    assert (first.turn, second.turn) == (1, 2) and [m["role"] for m in second.prompt] == ["user", "assistant", "user"]
    assert second.prompt[:2] == [*first.prompt, {"role": "assistant", "content": "a reply"}]


def test_percentiles_are_ordered_and_throughput_is_tokens_over_wall_time():
    values = [random.Random(i).expovariate(1.0) for i in range(101)]
    dist = Distribution.of(values)
    assert dist.min <= dist.p50 <= dist.p90 <= dist.p99 <= dist.max
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([5.0], 99) == 5.0

    def record(outcome: str, start: float, tokens: int | None = None) -> RequestRecord:
        r = RequestRecord("r", 0, 0, 8, 4, outcome=outcome, completion_tokens=tokens, prompt_tokens=8, sent=start)
        r.chunk_times = [start + 0.1 * k for k in range(1, 5)] if outcome == "ok" else []
        r.ended = start + 0.5
        return r

    records = [record("ok", 0.0, 4), record("ok", 0.2, 4), record("500", 0.3), record("cancelled", 0.4)]
    s = summarize(records, wall_s=2.0)
    assert (s.num_sent, s.num_ok, s.num_cancelled, s.errors) == (4, 2, 1, {"500": 1})
    assert s.output_tokens == 8 and s.output_tokens_per_s == 4.0 and s.requests_per_s == 1.0
    assert s.ttft.p50 == pytest.approx(0.1) and s.itl.mean == pytest.approx(0.1) and s.tpot.mean == pytest.approx(0.1)


# ---- against ember serve --------------------------------------------------------------------------


def test_two_concurrency_levels_against_ember(server, http):
    wait_idle(http)
    before = http.get("/health").json()["engine"]["generation_tokens"]
    config = BenchConfig(base_url=server.url, concurrency=[1, 2], input_len=48, output_len=6, num_requests=3,
                         quiet=True)
    result = run(config)
    assert [level.level.concurrency for level in result.levels] == [1, 2]
    assert result.model == "SmolLM2-135M-Instruct" and result.calibration.tokens_per_word > 0
    for level in result.levels:
        check_level(level, output_len=6)
        assert all(40 <= r.prompt_tokens <= 56 for r in level.records)  # calibrated to about 48
    after = wait_idle(http)["engine"]["generation_tokens"]
    counted = sum(level.summary.output_tokens for level in result.levels)
    assert after - before == counted + SETUP_OUTPUT_TOKENS  # the engine's own count agrees with usage
    report = format_report(result)
    assert "concurrency 1" in report and "concurrency 2" in report and "TTFT" in report


def test_open_loop_at_a_request_rate(server, http):
    result = run(BenchConfig(base_url=server.url, request_rates=[8.0], endpoint="completions", input_len=24,
                             output_len=4, num_requests=4, quiet=True))
    (level,) = result.levels
    assert level.level.request_rate == 8.0
    check_level(level, output_len=4)
    sends = [r.sent for r in level.records]
    assert sends == sorted(sends) and sends[-1] > sends[0]  # spread by the Poisson arrivals, not all at once
    wait_idle(http)


def test_two_turn_conversations_report_ttft_by_turn(server, http):
    result = run(BenchConfig(base_url=server.url, workload="multiturn", turns=2, concurrency=[2], input_len=40,
                             output_len=5, quiet=True))
    (level,) = result.levels
    check_level(level, output_len=5)
    assert len(level.records) == 4
    first, second = level.summary.by_turn
    assert (first.turn, first.count, second.turn, second.count) == (1, 2, 2, 2)
    assert second.prompt_tokens_mean > first.prompt_tokens_mean + 40  # the reply and a new message were added
    # Turn 1's prompt is a prefix of turn 2's, cached but for its last partial block of 16 tokens.
    assert second.cached_tokens_mean >= first.prompt_tokens_mean - 16
    for conversation in (0, 1):
        turns = [r for r in level.records if r.conversation == conversation]
        assert [r.turn for r in turns] == [1, 2] and turns[0].ended <= turns[1].sent
    assert "TTFT by turn" in format_report(result)
    wait_idle(http)


def test_a_level_past_max_seconds_cancels_its_streams(server, http):
    result = run(BenchConfig(base_url=server.url, concurrency=[2], input_len=24, output_len=900, num_requests=4,
                             max_seconds=1.0, quiet=True))
    (level,) = result.levels
    assert level.stopped_by == "max_seconds" and level.summary.num_cancelled == 2
    assert all(r.outcome == "cancelled" and r.ended is not None for r in level.records)
    wait_idle(http)  # the server saw the streams close and freed them


def test_the_cli_writes_every_request_to_json(server, http, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([*bench_command(), "--base-url", server.url + "/v1", "--endpoint", "completions",
                           "--concurrency", "1,2", "--num-requests", "2", "--input-len", "20:30", "--output-len", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^concurrency 2\s+2\s+2\s+0\s", done.stdout, re.M), done.stdout
    document = json.loads(out.read_text())
    assert document["model"] == "SmolLM2-135M-Instruct" and document["config"]["endpoint"] == "completions"
    assert [len(level["requests"]) for level in document["levels"]] == [2, 2]
    for level in document["levels"]:
        assert level["summary"]["output_tokens"] == 6
        for request in level["requests"]:
            assert request["outcome"] == "ok" and request["completion_tokens"] == 3
            assert request["ttft"] > 0 and request["chunk_times"][0] == request["first_token"]
    wait_idle(http)


def test_help_documents_the_flags():
    text = subprocess.run([*bench_command(), "--help"], capture_output=True, text=True, timeout=120).stdout
    for flag in ("--base-url", "--endpoint", "--concurrency", "--request-rate", "--input-len", "--output-len",
                 "--workload", "--turns", "--seed", "--num-requests", "--max-seconds", "--json", "--plot", "--offline"):
        assert flag in text, flag


# ---- against a server that fails ------------------------------------------------------------------

# The request index (from the x-request-id the bench sends) picks the failure, so the counts are exact.
BEHAVIOURS = ["ok", "500", "429", "stream_error", "incomplete"]


class FlakyServer:
    """A real HTTP server speaking just enough of the OpenAI API to be benchmarked."""

    def __init__(self, chunk_delay: float = 0.0, num_chunks: int = 3) -> None:
        self.chunk_delay = chunk_delay
        self.num_chunks = num_chunks
        self.streams_started = threading.Event()
        self.disconnects = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_json(200, {"object": "list", "data": [{"id": "flaky-model", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body.get("prompt") or body["messages"][-1]["content"]
                usage = {"prompt_tokens": len(prompt.split()) + 3, "completion_tokens": body["max_tokens"]}
                if not body.get("stream"):  # calibration
                    self.send_json(200, {"choices": [{"index": 0, "text": "x"}], "usage": usage})
                    return
                found = re.search(r"-r(\d+)$", self.headers.get("x-request-id", ""))
                behaviour = BEHAVIOURS[int(found.group(1)) % len(BEHAVIOURS)] if found else "ok"
                if behaviour in ("500", "429"):
                    self.send_json(int(behaviour), {"error": {"message": f"failing on purpose ({behaviour})"}})
                    return
                if found:
                    outer.streams_started.set()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    self.stream(behaviour, usage, min(outer.num_chunks, body["max_tokens"]))
                except (BrokenPipeError, ConnectionResetError):
                    outer.disconnects += 1

            def stream(self, behaviour: str, usage: dict, num_chunks: int) -> None:
                for _ in range(num_chunks):
                    self.event({"choices": [{"index": 0, "delta": {"content": "word "}, "text": "word "}]})
                    time.sleep(outer.chunk_delay)
                if behaviour == "incomplete":
                    return  # the connection closes without [DONE]
                if behaviour == "stream_error":
                    self.event({"error": {"message": "the engine failed"}})
                else:
                    self.event({"choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")

            def event(self, payload: dict) -> None:
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            def send_json(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FlakyServer":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_failures_are_counted_by_status_not_crashed_on():
    with FlakyServer() as flaky:
        result = run(BenchConfig(base_url=flaky.url, concurrency=[2], input_len=16, output_len=3, num_requests=10,
                                 quiet=True))
    (level,) = result.levels
    s = level.summary
    assert result.model == "flaky-model"
    assert (s.num_sent, s.num_ok) == (10, 2)
    assert s.errors == {"429": 2, "500": 2, "incomplete": 2, "stream_error": 2}
    assert {r.status for r in level.records if r.outcome in ("429", "500")} == {429, 500}
    assert all("on purpose" in r.error for r in level.records if r.outcome in ("429", "500"))
    assert s.output_tokens == 6 and s.ttft is not None and s.ttft.count == 2
    assert "429 x2" in format_report(result) and "500 x2" in format_report(result)


def test_ctrl_c_cancels_the_streams_and_still_reports(tmp_path):
    out = tmp_path / "interrupted.json"
    with FlakyServer(chunk_delay=0.2, num_chunks=200) as flaky:
        bench = subprocess.Popen([*bench_command(), "--base-url", flaky.url, "--concurrency", "2",
                                  "--num-requests", "5", "--input-len", "16", "--output-len", "200",
                                  "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert flaky.streams_started.wait(60)
        time.sleep(0.5)
        bench.send_signal(signal.SIGINT)
        stdout, stderr = bench.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while flaky.disconnects < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flaky.disconnects >= 1  # the open streams were closed by the client, not left running
    assert bench.returncode == 130, stderr
    assert "stopped by Ctrl-C" in stdout
    (level,) = json.loads(out.read_text())["levels"]
    assert level["stopped_by"] == "interrupt"
    assert any(r["outcome"] == "cancelled" for r in level["requests"])


def test_plot_draws_a_png(tmp_path):
    from ember.bench.plot import write_plot

    with FlakyServer() as flaky:
        result = run(BenchConfig(base_url=flaky.url, concurrency=[1, 2], input_len=8, output_len=2, num_requests=1,
                                 quiet=True))
    write_plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    from ember.bench import plot

    monkeypatch.setattr(plot.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BenchError, match=r"pip install 'ember\[plot\]'"):
        plot.require_matplotlib()


# ---- offline --------------------------------------------------------------------------------------


def test_offline_runs_the_same_workload_on_the_engine():
    result = run(BenchConfig(offline=OfflineSettings(max_model_len=256), concurrency=[2], input_len=32, output_len=4,
                             num_requests=2, quiet=True))
    (level,) = result.levels
    check_level(level, output_len=4, http=False)
    assert result.model == "SmolLM2-135M-Instruct" and result.target.startswith("offline")
    # after the run, the machine's limits on the engine's threads and this model's bounds
    bounds = result.bounds
    assert bounds is not None and bounds.limits.threads >= 1 and bounds.weight_bytes > 0
    assert 130e6 < bounds.num_weights < 140e6  # SmolLM2-135M, its tied table counted once
    report = format_report(result)
    assert bounds.describe() in report and "concurrency 2 output" in report
    assert result.to_json()["bounds"]["weight_bytes"] == bounds.weight_bytes
