"""Run coding agents one-shot against ember: Claude Code, Codex, Pi and opencode, in every dialect each speaks.

    python scripts/agents.py                       # install the agents, start ember, run everything
    python scripts/agents.py --only pi,opencode    # some agents
    python scripts/agents.py --base-url http://127.0.0.1:8000 --log ember.log   # a server you started

The agents install from the npm registry into .agents/ (git-ignored). Each run gets a fresh HOME,
no telemetry, no update checks, and only 127.0.0.1 to talk to. A run passes when the agent exits 0
with non-empty output and ember answered none of its requests with a 4xx or 5xx. Each agent runs
twice; the second run's cached prompt tokens (from ember's request log) show prefix reuse.
Not part of the test suite: it needs the npm registry once and several minutes per agent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENTS_DIR = ROOT / ".agents"
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex",
            "pi": "@mariozechner/pi-coding-agent", "opencode": "opencode-ai"}
PROMPT = "Answer in one short sentence: what is the capital of France?"
KEY = "ember-local-key"
# Claude Code's full tool set makes a 20,000-token prompt, past what a small model can follow: the
# default model never ends its turn there (see docs/agents.md). Three tools keep its request's shape.
LEAN_CLAUDE_TOOLS = "Bash,Read,Edit"
_STATUS_LINE = re.compile(r" (GET|POST|DELETE|PUT|HEAD) (\S+) (\d{3}) ")


@dataclass
class Run:
    agent: str
    dialect: str
    exit_code: int | None = None
    seconds: float = 0.0
    output: str = ""
    bad_statuses: list[str] = field(default_factory=list)
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    client_gone: int = 0

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and bool(self.output.strip()) and not self.bad_statuses


class Ember:
    """A server to run against: started here (with a request log), or one given by URL."""

    def __init__(self, args) -> None:
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.request_log = Path(args.request_log or tempfile.mktemp(suffix=".jsonl"))
        self.url = args.base_url

    def start(self) -> None:
        if self.url:
            return
        command = [sys.executable, "-m", "ember.cli", "serve", "--port", str(self.args.port),
                   "--max-model-len", str(self.args.max_model_len), "--request-log", str(self.request_log),
                   "--log-stats-interval", "0"]
        if self.args.model:
            command.insert(4, self.args.model)
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        ready = threading.Event()

        def drain() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip("\n"))
                if "(Ctrl-C stops)" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(600) or self.proc.poll() is not None:
            raise SystemExit("ember serve did not start:\n" + "\n".join(self.lines[-20:]))
        self.url = f"http://127.0.0.1:{self.args.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)

    def model_id(self) -> str:
        import httpx
        return httpx.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]

    def mark(self) -> tuple[int, int]:
        size = self.request_log.stat().st_size if self.request_log.exists() else 0
        return len(self.lines), size

    def since(self, mark: tuple[int, int], run: Run) -> None:
        """What ember saw of one run: bad statuses from its request lines, tokens from its request log."""
        lines, offset = mark
        for line in self.lines[lines:]:
            found = _STATUS_LINE.search(line)
            if found and int(found.group(3)) >= 400:
                run.bad_statuses.append(f"{found.group(1)} {found.group(2)} {found.group(3)}")
        if not self.request_log.exists():
            return
        with open(self.request_log, encoding="utf-8") as log:
            log.seek(offset)
            for line in log:
                event = json.loads(line)
                if event.get("event") in ("request_done", "request_error"):
                    run.requests += 1
                    run.prompt_tokens += event.get("prompt_tokens") or 0
                    run.cached_tokens += event.get("cached_tokens") or 0
                if event.get("code") == "client_gone":
                    run.client_gone += 1  # the agent closed a stream it no longer wanted: not ember's error
                elif event.get("event") in ("request_error", "request_rejected"):
                    run.bad_statuses.append(f"{event.get('protocol')} {event.get('status')} {event.get('code')}")


def install(names: list[str]) -> None:
    missing = [PACKAGES[n] for n in names if not _binary(n)]
    if missing:
        AGENTS_DIR.mkdir(exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(AGENTS_DIR), "--no-audit", "--no-fund", *missing], check=True)


def _binary(name: str) -> Path | None:
    path = AGENTS_DIR / "node_modules" / ".bin" / name
    return path if path.exists() else None


def fresh_env(home: Path) -> dict[str, str]:
    env = {"PATH": f"{AGENTS_DIR / 'node_modules' / '.bin'}:{os.environ['PATH']}", "HOME": str(home),
           "TERM": "dumb", "NO_COLOR": "1", "LANG": "C.UTF-8",
           # Nothing beyond 127.0.0.1: proxies that lead nowhere catch what the settings below miss.
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "npm_config_registry": "http://127.0.0.1:9/"}
    return env


def agent_command(agent: str, dialect: str, url: str, model: str, home: Path,
                  claude_tools: str = LEAN_CLAUDE_TOOLS) -> tuple[list[str], dict[str, str]]:
    env = fresh_env(home)
    if agent == "claude":
        env.update({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": model,
                    "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                    "CLAUDE_CONFIG_DIR": str(home / ".claude"), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
                    # A CPU takes minutes over Claude Code's 20,000-token first prompt; its default
                    # watchdog gives up on a stream silent for 5 minutes.
                    "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000", "API_TIMEOUT_MS": "1800000"})
        tools = [] if claude_tools == "default" else ["--tools", claude_tools]
        return ["claude", "-p", PROMPT, "--model", model, "--output-format", "text", *tools], env
    if agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True)
        (codex_home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "local"\napproval_policy = "never"\nsandbox_mode = "read-only"\n'
            f'check_for_update_on_startup = false\n\n[model_providers.local]\nname = "ember"\n'
            f'base_url = "{url}/v1"\nenv_key = "EMBER_KEY"\nwire_api = "responses"\n\n'
            f'[analytics]\nenabled = false\n\n[feedback]\nenabled = false\n\n[features]\nplugins = false\n')
        env.update({"CODEX_HOME": str(codex_home), "EMBER_KEY": KEY})
        return ["codex", "exec", "--skip-git-repo-check", "--ephemeral", "--color", "never", "-m", model, PROMPT], env
    if agent == "pi":
        pi_dir = home / ".pi"
        pi_dir.mkdir(parents=True)
        api = {"chat": "openai-completions", "responses": "openai-responses", "anthropic": "anthropic-messages"}[dialect]
        base = url if dialect == "anthropic" else f"{url}/v1"
        (pi_dir / "models.json").write_text(json.dumps({"providers": {"local": {
            "baseUrl": base, "api": api, "apiKey": KEY,
            "models": [{"id": model, "name": model, "contextWindow": 32768, "maxTokens": 4096}]}}}))
        env.update({"PI_CODING_AGENT_DIR": str(pi_dir), "PI_OFFLINE": "1"})
        return ["pi", "-p", "--no-session", "--provider", "local", "--model", model, PROMPT], env
    if agent == "opencode":
        npm = {"chat": "@ai-sdk/openai-compatible", "responses": "@ai-sdk/openai", "anthropic": "@ai-sdk/anthropic"}[dialect]
        base = f"{url}/v1"
        config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
                  "provider": {"local": {"npm": npm, "name": "ember", "options": {"baseURL": base, "apiKey": KEY},
                                         "models": {model: {"name": model}}}}}
        env.update({"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
                    "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"})
        return ["opencode", "run", "-m", f"local/{model}", PROMPT], env
    raise ValueError(agent)


DIALECTS = {"claude": ["anthropic"], "codex": ["responses"], "pi": ["chat", "responses", "anthropic"],
            "opencode": ["chat", "responses", "anthropic"]}


def run_agent(ember: Ember, agent: str, dialect: str, model: str, timeout: float,
              claude_tools: str = LEAN_CLAUDE_TOOLS) -> Run:
    run = Run(agent, dialect)
    # The same paths on every run: agents write their working directory into the prompt, and a
    # changing path would end the prefix the second run can reuse.
    home = Path(tempfile.gettempdir()) / "ember-agent-runs" / f"{agent}-{dialect}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    try:
        command, env = agent_command(agent, dialect, ember.url, model, home, claude_tools)
        work = home / "work"
        work.mkdir()
        mark = ember.mark()
        began = time.monotonic()
        try:
            done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
            run.exit_code, run.output = done.returncode, done.stdout
            if done.returncode != 0:
                run.output += "\n[stderr] " + done.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            run.exit_code, run.output = None, f"timed out after {timeout:.0f} s: {(exc.stdout or '')[-500:]}"
        run.seconds = time.monotonic() - began
        time.sleep(1.0)  # the request log's terminal events follow the end of each exchange
        ember.since(mark, run)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PACKAGES), help="agents to run, comma-separated")
    parser.add_argument("--base-url", default=None, help="a running ember (default: start one here)")
    parser.add_argument("--request-log", default=None, help="that server's --request-log file, for token counts")
    parser.add_argument("--model", default=None, help="model for the server started here (default model)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per agent run")
    parser.add_argument("--json", default=None, help="write every run's result here")
    parser.add_argument("--claude-tools", default=LEAN_CLAUDE_TOOLS,
                        help=f"Claude Code's --tools (default {LEAN_CLAUDE_TOOLS}; 'default': all of them, "
                             "a 20,000-token prompt for a model that can follow it)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    if not shutil.which("npm"):
        raise SystemExit("npm is needed to install the agents")
    install(names)
    ember = Ember(args)
    ember.start()
    runs: list[Run] = []
    try:
        model = ember.model_id()
        for name in names:
            for dialect in DIALECTS[name]:
                for attempt in (1, 2):
                    run = run_agent(ember, name, dialect, model, args.timeout, args.claude_tools)
                    runs.append(run)
                    print(f"{name:9} {dialect:10} run {attempt}: {'pass' if run.passed else 'FAIL'} "
                          f"exit={run.exit_code} {run.seconds:6.1f}s requests={run.requests} "
                          f"prompt={run.prompt_tokens} cached={run.cached_tokens} left={run.client_gone} "
                          f"bad={run.bad_statuses[:3]} output={run.output.strip()[:80]!r}", flush=True)
    finally:
        ember.stop()
    if args.json:
        Path(args.json).write_text(json.dumps([run.__dict__ for run in runs], indent=1))
    return 0 if all(r.passed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
