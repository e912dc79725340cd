"""Model names: what an argument names, which GGUF file a quantization tag picks, which repo files are fetched."""

from __future__ import annotations

import pytest

from ember.errors import ModelLoadError
from ember.loaders.gguf_choice import choose_gguf, choose_mmproj, quant_bits, quant_tag
from ember.loaders.hub import files_to_fetch
from ember.loaders.model_names import parse_model_name


@pytest.mark.parametrize("text, kind, repo_id, revision, tag", [
    ("Qwen/Qwen3-0.6B", "hub", "Qwen/Qwen3-0.6B", None, None),
    ("Qwen/Qwen3-0.6B@v1.0", "hub", "Qwen/Qwen3-0.6B", "v1.0", None),
    ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", "hub", "unsloth/Qwen3-0.6B-GGUF", None, "Q4_K_M"),
    ("unsloth/Qwen3-0.6B-GGUF@0123abc:Q8_0", "hub", "unsloth/Qwen3-0.6B-GGUF", "0123abc", "Q8_0"),
    ("./models/tiny", "path", "", None, None),
    ("/no/such/model.gguf", "path", "", None, None),
    ("ollama:qwen3:0.6b", "ollama", "qwen3", None, "0.6b"),
    ("ollama:someone/model", "ollama", "someone/model", None, None),
    ("ollama:smollm2", "ollama", "smollm2", None, None),
])
def test_what_a_model_argument_names(text, kind, repo_id, revision, tag):
    name = parse_model_name(text)
    assert (name.kind, name.repo_id, name.revision, name.tag) == (kind, repo_id, revision, tag)
    assert name.text == text and name.is_named == (kind in ("hub", "ollama"))


def test_an_existing_path_wins_over_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model_name("org/model").kind == "path"
    assert parse_model_name(None).kind == "default"


def test_revision_flag_and_at_revision_must_agree():
    assert parse_model_name("org/name", "dev").revision == "dev"
    assert parse_model_name("org/name@dev", "dev").revision == "dev"
    with pytest.raises(ModelLoadError, match="names revision 'dev' but --revision says 'main'") as caught:
        parse_model_name("org/name@dev", "main")
    assert caught.value.param == "revision"
    for not_a_repo in (None, "ollama:smollm2", "/no/such/folder"):
        with pytest.raises(ModelLoadError, match="--revision applies to a Hugging Face repo id") as caught:
            parse_model_name(not_a_repo, "dev")
        assert caught.value.param == "revision"


def test_a_malformed_ollama_name_is_refused():
    with pytest.raises(ModelLoadError, match="not an Ollama model name"):
        parse_model_name("ollama:bad name")


@pytest.mark.parametrize("filename, tag", [
    ("Qwen3-0.6B-Q4_K_M.gguf", "Q4_K_M"), ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
    ("model-q8_0.gguf", "Q8_0"), ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
    ("tiny-BF16.gguf", "BF16"), ("sub/dir/tiny.F16.gguf", "F16"), ("notag.gguf", None),
])
def test_quantization_tags_are_read_from_file_names(filename, tag):
    assert quant_tag(filename) == tag


GGUF_REPO = {"m-Q8_0.gguf": 800, "m-Q4_K_M.gguf": 500, "m-Q4_0.gguf": 450, "m-IQ4_XS.gguf": 400, "m-F16.gguf": 1600}


def test_a_tag_picks_its_file_in_any_case():
    assert choose_gguf(GGUF_REPO, "Q8_0", "org/m") == "m-Q8_0.gguf"
    assert choose_gguf(GGUF_REPO, "q4_k_m", "org/m") == "m-Q4_K_M.gguf"


def test_without_a_tag_q4_k_m_else_the_smallest_4_bit_file_else_the_smallest():
    assert choose_gguf(GGUF_REPO, None, "org/m") == "m-Q4_K_M.gguf"
    without = {k: v for k, v in GGUF_REPO.items() if "K_M" not in k}
    assert choose_gguf(without, None, "org/m") == "m-IQ4_XS.gguf"
    assert choose_gguf({"m-Q8_0.gguf": 800, "m-F16.gguf": 1600}, None, "org/m") == "m-Q8_0.gguf"


def test_an_unknown_tag_lists_the_tags_there_are():
    with pytest.raises(ModelLoadError) as caught:
        choose_gguf(GGUF_REPO, "Q5_K_S", "org/m")
    assert caught.value.message == ("org/m has no GGUF file for the tag 'Q5_K_S'; it has: F16, IQ4_XS, Q4_0, "
                                    "Q4_K_M, Q8_0")
    assert caught.value.param == "model"


def test_a_split_gguf_file_is_refused_with_the_alternatives():
    split = {"m-Q4_K_M-00001-of-00002.gguf": 5, "m-Q4_K_M-00002-of-00002.gguf": 5, "m-Q8_0.gguf": 9}
    with pytest.raises(ModelLoadError, match="split into parts.*Q4_K_M, Q8_0"):
        choose_gguf(split, "Q4_K_M", "org/m")


def test_a_safetensors_repo_fetches_its_config_tokenizer_and_weights_only():
    repo = {name: 1 for name in (
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "chat_template.jinja", "model.safetensors", "pytorch_model.bin", "README.md", ".gitattributes",
        "onnx/model.onnx", "original/model.safetensors", "flax_model.msgpack")}
    assert files_to_fetch(repo, parse_model_name("org/m")) == [
        "chat_template.jinja", "config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "model.safetensors"]


def test_a_sharded_repo_fetches_its_index_first():
    repo = {"config.json": 1, "tokenizer.json": 1, "model.safetensors.index.json": 1,
            "model-00001-of-00002.safetensors": 1, "model-00002-of-00002.safetensors": 1, "consolidated.safetensors": 1}
    assert files_to_fetch(repo, parse_model_name("org/m")) == ["config.json", "tokenizer.json",
                                                                 "model.safetensors.index.json"]


def test_a_repo_of_pickles_is_refused():
    with pytest.raises(ModelLoadError, match=r"org/m has no \*\.safetensors weights \(it has pytorch_model\.bin; "
                                             r"ember loads safetensors only\)"):
        files_to_fetch({"config.json": 1, "pytorch_model.bin": 1}, parse_model_name("org/m"))


def test_a_gguf_repo_fetches_one_model_file_and_its_mmproj():
    assert files_to_fetch({**GGUF_REPO, "README.md": 1}, parse_model_name("org/m")) == ["m-Q4_K_M.gguf"]
    repo = {**GGUF_REPO, "README.md": 1, "mmproj-m-F16.gguf": 1, "mmproj-m-Q8_0.gguf": 1}
    assert files_to_fetch(repo, parse_model_name("org/m")) == ["m-Q4_K_M.gguf", "mmproj-m-Q8_0.gguf"]
    assert files_to_fetch(repo, parse_model_name("org/m:F16")) == ["m-F16.gguf", "mmproj-m-F16.gguf"]
    with pytest.raises(ModelLoadError, match="neither a config.json nor GGUF files"):
        files_to_fetch({"README.md": 1}, parse_model_name("org/m"))


def test_the_mmproj_beside_a_model_file_is_the_nearest_in_precision_then_the_more_precise():
    names = ["mmproj-m-F16.gguf", "mmproj-m-Q8_0.gguf", "mmproj-m-F32.gguf", "sub/mmproj-m-Q4_0.gguf"]
    assert choose_mmproj(names, "m-Q4_K_M.gguf") == "mmproj-m-Q8_0.gguf"  # 8 bits is nearest to 4
    assert choose_mmproj(names, "m-BF16.gguf") == "mmproj-m-F16.gguf"
    assert choose_mmproj(names, "notag.gguf") == "mmproj-m-Q8_0.gguf"
    assert choose_mmproj(names, "sub/m-Q4_K_M.gguf") == "sub/mmproj-m-Q4_0.gguf"  # its own folder's
    assert choose_mmproj(["mmproj-a.gguf", "mmproj-b.gguf"], "m-F16.gguf") == "mmproj-a.gguf"  # then by name
    assert choose_mmproj(["m-F16.gguf", "other/mmproj-m-F16.gguf", "mmproj.txt"], "m-Q8_0.gguf") is None
    assert [quant_bits(n) for n in ("m-Q4_K_M.gguf", "mmproj-x-f16.gguf", "m-IQ2_XS.gguf", "m.gguf")] == [4, 16, 2, 0]
