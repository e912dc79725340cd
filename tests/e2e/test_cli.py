"""`ember serve` on the command line: help text, settings from flags and environment, refusals at start."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from conftest import serve_command
from ember.engine.loading import resolve_device
from ember.server.flags import add_serve_parser, build_config

FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--max-model-len", "--max-num-seqs",
         "--max-num-batched-tokens", "--max-pending", "--pending-timeout", "--max-request-mb", "--cors-origins",
         "--no-prefix-caching", "--dtype", "--seed", "--chat-template", "--default-max-tokens", "--log-level",
         "--request-log", "--log-stats-interval", "--rope-scaling", "--revision", "ollama:NAME",
         "--tensor-parallel-size", "--nnodes", "--node-rank", "--dist-init-addr"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ember")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_help_explains_every_flag():
    text = subprocess.run([*serve_command(), "--help"], capture_output=True, text=True, timeout=120).stdout
    for flag in FLAGS:
        assert flag in text, flag


def test_the_serve_module_runs_as_a_program():
    """`python -m ember.server.cli serve` gets as far as loading: a model that is not there ends it
    with exit status 1 and the reason."""
    done = subprocess.run([sys.executable, "-m", "ember.server.cli", "serve", "--port", "0", "/no/such/model.gguf"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot load /no/such/model.gguf" in done.stderr and "Traceback" not in done.stderr


def test_device_auto_is_the_cpu_until_the_cuda_path_is_checked(monkeypatch, caplog):
    """Even where CUDA is present (stood in for here: this machine has none), `auto` serves on the
    CPU and says why; a GPU is used when named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_config(parse(), environ={}).engine.device == "auto"
    assert resolve_device("auto") == torch.device("cpu")
    assert "--device cuda" in caplog.text
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_public_address_without_a_key_is_refused_at_start():
    env = {k: v for k, v in os.environ.items() if k != "EMBER_API_KEY"}
    done = subprocess.run([*serve_command(), "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode != 0
    assert "--allow-no-api-key" in done.stderr and "--api-key" in done.stderr


def test_settings_from_flags_and_environment(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = parse("some/model", "--served-model-name", "pub,alias1", "--served-model-name", "alias2",
                 "--cors-origins", "http://a.example,http://b.example", "--max-request-mb", "0.5",
                 "--max-num-seqs", "3", "--no-prefix-caching", "--chat-template", str(template),
                 "--pending-timeout", "2.5", "--revision", "v2")
    config = build_config(args, environ={"EMBER_API_KEY": "from-env", "EMBER_CACHE_DIR": "/tmp/cache",
                                         "OLLAMA_MODELS": "/tmp/ollama"})
    assert config.model == "some/model" and config.served_model_names == ["pub", "alias1", "alias2"]
    assert config.cors_origins == ["http://a.example", "http://b.example"]
    assert config.max_request_bytes == 512 * 1024 and config.pending_timeout == 2.5
    assert config.api_key == "from-env" and config.cache_dir == "/tmp/cache"
    assert config.revision == "v2" and config.ollama_models == "/tmp/ollama"
    assert config.engine.max_num_seqs == 3 and config.engine.enable_prefix_caching is False
    assert config.chat_template == "{{ messages[0]['content'] }}"
    assert build_config(parse("--host", "0.0.0.0", "--allow-no-api-key"), environ={}).api_key is None
    assert build_config(parse("--host", "::1"), environ={}).host == "::1"
    yarn = build_config(parse("--rope-scaling", '{"rope_type": "yarn", "factor": 4}'), environ={})
    assert yarn.engine.rope_scaling == {"rope_type": "yarn", "factor": 4}


def test_rope_scaling_that_is_not_a_json_object_is_a_usage_error(capsys):
    for text in ("yarn", "[4]"):
        with pytest.raises(SystemExit):
            parse("--rope-scaling", text)
        assert "--rope-scaling" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--host", "192.168.1.5"], ["--chat-template", "/no/such/file"],
                                  ["--max-request-mb", "0"], ["--log-stats-interval", "-1"],
                                  ["--rope-scaling", '{"rope_type": "yarn", "factor": 0.5}'],
                                  ["--reasoning-key-file", "/no/such/file"]])
def test_bad_settings_are_refused_with_a_message(argv):
    with pytest.raises(ValueError):
        build_config(parse(*argv), environ={})
