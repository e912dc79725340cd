"""`ember serve`'s several models: names on the command line, a scanned --models-dir, a TOML or YAML
--models-config with aliases and per-model flags, and the refusals of what cannot be served."""

from __future__ import annotations

import pytest

from ember.server.flags import serve_parser
from ember.server.model_catalog import model_configs


def configs(*argv: str):
    return model_configs(serve_parser().parse_args(list(argv)))


def write(path, text: str):
    path.write_text(text)
    return path


def test_one_model_is_served_as_before(tmp_path):
    (config,), policy = configs("m.gguf", "--served-model-name", "chat,alias")
    assert config.model == "m.gguf" and config.served_model_names == ["chat", "alias"]
    assert policy.max_loaded is None and policy.memory_mib is None and policy.idle_unload_s is None
    (default,), _ = configs()
    assert default.model is None


def test_several_names_on_the_command_line_each_get_their_own_settings(tmp_path):
    gguf = write(tmp_path / "small.Q4_K_M.gguf", "")
    (tmp_path / "folder").mkdir()
    models, policy = configs(str(gguf), str(tmp_path / "folder"), "org/repo:Q8_0", "--max-model-len", "512",
                             "--max-loaded-models", "2", "--idle-unload-seconds", "30", "--models-memory-mib", "900")
    assert [m.served_model_names for m in models] == [["small.Q4_K_M"], ["folder"], ["org/repo:Q8_0"]]
    assert [m.model for m in models] == [str(gguf), str(tmp_path / "folder"), "org/repo:Q8_0"]
    assert all(m.engine.max_model_len == 512 for m in models)
    assert (policy.max_loaded, policy.idle_unload_s, policy.memory_mib) == (2, 30.0, 900.0)


def test_a_models_file_gives_names_aliases_and_per_model_flags(tmp_path):
    models_file = write(tmp_path / "models.toml", """
[models.chat]
model = "org/chat:Q4_K_M"
aliases = ["default", "assistant"]
max_model_len = 8192
quantization = "int8"
speculate = "ngram"
no_prefix_caching = true
temperature = 0.3

[models.embed]
model = "org/embedder"
embeddings = true
""")
    chat, embed = configs("--models-config", str(models_file), "--max-model-len", "1024", "--port", "9000")[0]
    assert chat.served_model_names == ["chat", "default", "assistant"] and chat.model == "org/chat:Q4_K_M"
    assert chat.engine.max_model_len == 8192 and chat.engine.quantization == "int8"
    assert chat.engine.speculative.mode == "ngram" and chat.engine.enable_prefix_caching is False
    assert chat.sampling_flags["temperature"] == 0.3
    assert embed.embeddings is True and embed.engine.max_model_len == 1024  # the command line's
    assert embed.engine.enable_prefix_caching is True and chat.port == embed.port == 9000


def test_yaml_takes_the_same_shape(tmp_path):
    models_file = write(tmp_path / "models.yaml", "models:\n  a:\n    model: x.gguf\n    max_model_len: 300\n"
                                                  "  b:\n    model: y.gguf\n    aliases: [bee]\n")
    a, b = configs("--models-config", str(models_file))[0]
    assert a.engine.max_model_len == 300 and b.served_model_names == ["b", "bee"]


def test_a_models_dir_serves_its_gguf_files_and_model_folders_but_not_projectors(tmp_path):
    write(tmp_path / "b-model.gguf", "")
    write(tmp_path / "mmproj-b-model-f16.gguf", "")
    (tmp_path / "a-folder").mkdir()
    write(tmp_path / "a-folder" / "config.json", "{}")
    (tmp_path / "not-a-model").mkdir()
    write(tmp_path / "notes.txt", "")
    models, _ = configs("org/first", "--models-dir", str(tmp_path))
    assert [m.served_model_names[0] for m in models] == ["org/first", "a-folder", "b-model"]


@pytest.mark.parametrize("text, words", [
    ('[models.a]\nmodel = "x"\nport = 9000\n', "'port' is not a per-model setting"),
    ('[models.a]\nmodel = "x"\nmax_model_len = "long"\n', "models.a"),
    ('[models.a]\nmodel = "x"\nno_prefix_caching = "yes"\n', "is a switch"),
    ('[models.a]\naliases = ["b"]\n', "needs `model`"),
    ('[models.a]\nmodel = "x"\naliases = "b"\n', "aliases must be a list"),
    ('[models.a]\nmodel = "x"\n[models.b]\nmodel = "y"\naliases = ["a"]\n', "two models are served as 'a'"),
    ("models = 3\n", "has no models"),
    ("[models\n", "does not parse"),
])
def test_a_models_file_that_cannot_be_served_is_refused_with_its_place(tmp_path, text, words):
    models_file = write(tmp_path / "models.toml", text)
    with pytest.raises(ValueError) as refused:
        configs("--models-config", str(models_file))
    assert words in str(refused.value)


def test_refusals_of_the_command_line(tmp_path):
    with pytest.raises(ValueError, match="--served-model-name names the one model"):
        configs("a.gguf", "b.gguf", "--served-model-name", "x")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    with pytest.raises(ValueError, match="two models are served as 'same'"):
        configs(str(write(tmp_path / "one" / "same.gguf", "")), str(write(tmp_path / "two" / "same.gguf", "")))
    with pytest.raises(ValueError, match="is not a folder"):
        configs("--models-dir", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .gguf file"):
        configs("--models-dir", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--max-loaded-models must be at least 1"):
        configs("--max-loaded-models", "0")
