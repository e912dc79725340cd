"""`ember serve`: running the server until Ctrl-C or SIGTERM (its flags: ember.server.flags).

ember/cli.py wires it in with `add_serve_parser(subcommands)` and `run_serve(args)`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from ember.server.flags import add_serve_parser, parallel_flags, redact_argv


def run_serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from ember.server.model_catalog import model_configs

    try:
        models, policy = model_configs(args)
    except ValueError as exc:
        print(f"ember serve: {exc}", file=sys.stderr)
        return 2
    config = models[0]
    parallel = parallel_flags(args)
    if parallel["node_rank"] > 0:  # ranks only: no HTTP, no model of its own (rank 0 sends the settings)
        from ember.engine.ranks import run_node

        return run_node(config.engine, parallel["node_rank"], parallel["local_rank"])
    try:
        request_log = _open_request_log(config.request_log)
    except ValueError as exc:
        print(f"ember serve: {exc}", file=sys.stderr)
        return 2
    sockets = []
    for port in (config.port, config.ollama_port):
        if port is None:
            continue
        try:
            sockets.append(_bind(config.host, port))
        except OSError as exc:
            print(f"ember serve: cannot listen on {config.host}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    sock = sockets[0]
    import uvicorn

    from ember.server.app import create_app

    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    app = create_app(config, request_log=request_log, argv=redact_argv(sys.argv, config.api_key), models=models,
                     policy=policy)
    pool = app.state.pool
    if config.api_key_file and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: _reload_keys(pool.keys))
    page = f", chat page at {url}/" if config.ui else ""
    pool.ready_hooks.append(lambda state: print(
        f"ember: model {state.loaded.name} loaded in {state.load_seconds:.1f} s; serving it as "
        f"'{state.model.name}' at {url}/v1{page} (Ctrl-C stops)", file=sys.stderr, flush=True))
    pool.unload_hooks.append(lambda state, reason: print(
        f"ember: model '{pool.label(state)}' unloaded ({reason})", file=sys.stderr, flush=True))
    if pool.several:
        print(f"ember: serving {len(models)} models: {', '.join(pool.public_names())}; requests without a "
              f"model go to '{pool.public_names()[0]}'", file=sys.stderr, flush=True)
    print(f"ember: listening on {url}; loading {config.model or 'the default model'} ...", file=sys.stderr, flush=True)
    if len(sockets) > 1:
        print(f"ember: Ollama's clients may also use port {sockets[1].getsockname()[1]}", file=sys.stderr, flush=True)
    server = _make_server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=config.drain_timeout + 5), pool)
    load_failure: list[str] = []

    def stop_on_load_failure(reason: str) -> None:  # a server that can never serve must not look alive
        load_failure.append(reason)
        server.should_exit = True

    if not pool.several:  # with several, the others keep serving; the failed one answers 503
        pool.load_failed_hooks.append(stop_on_load_failure)
    # uvicorn handles SIGTERM (a drain) and sends it again once it has stopped; by then the work is
    # done, so the second one ends the process normally instead of killing it.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; stopping is what was asked
        pass
    if load_failure:
        print(f"ember serve: cannot load {config.model or 'the default model'}: {load_failure[0]}",
              file=sys.stderr, flush=True)
        return 1
    print("ember: stopped", file=sys.stderr, flush=True)
    if any(state.status == "loading" for state in pool.states):  # do not wait for (or trip over) a loading thread
        os._exit(0)
    return 0


def _reload_keys(keys) -> None:
    try:
        count = keys.reload()
    except ValueError as exc:
        print(f"ember: SIGHUP: the API keys are unchanged: {exc}", file=sys.stderr, flush=True)
        return
    print(f"ember: SIGHUP: {count} API keys in force from {keys.key_file}", file=sys.stderr, flush=True)


def _open_request_log(path: str | None):
    from ember.server.request_log import RequestLog, RequestLogError

    try:
        return RequestLog.open(path) if path else None
    except RequestLogError as exc:
        raise ValueError(str(exc)) from None


_SEND_BUFFER_BYTES = 256 << 10  # Linux doubles it for its own bookkeeping
TCP_USER_TIMEOUT_MS = 15_000


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # TCP keepalive, inherited by accepted connections: a peer that vanished without a word (a
    # laptop closed, a network gone) is noticed in about two minutes and its requests end.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # TCP_USER_TIMEOUT: data the peer leaves unacknowledged for 15 s ends the connection, so a peer
    # gone mid-stream is noticed in seconds, not after the kernel's retransmissions (minutes).
    for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6),
                          ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    # A bounded send buffer (the kernel would grow it to 4 MiB): a client that stops reading then
    # blocks the stream's writes after about half a MiB, and the stalled-client timeout can start.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if level != "debug":
        for noisy in ("uvicorn", "torch", "transformers"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _make_server(config, state):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which drains on SIGTERM or Ctrl-C: nothing new is admitted, running
        requests get the drain timeout to finish, then the rest end with an error. A second
        signal ends them at once."""

        def handle_exit(self, sig, frame) -> None:
            loop = getattr(state, "loop", None)
            if loop is not None:
                if not self.should_exit:
                    drain = state.config.drain_timeout
                    print(f"ember: stopping; running requests have {drain:g} s to finish", file=sys.stderr,
                          flush=True)
                    loop.call_soon_threadsafe(state.begin_drain, drain)
                else:
                    print("ember: stopping now; running requests are cancelled", file=sys.stderr, flush=True)
                    loop.call_soon_threadsafe(state.begin_shutdown)
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
