"""A vision model as llama.cpp ships it: a tiny random SmolVLM folder converted by llama.cpp's own
converter (tests/gguf_vision.py) into the language GGUF and its mmproj, in float16 and in Q8_0.
The float16 pair holds the folder's weights exactly (they are float16 values), so ember's answers
from it equal its answers from the folder bit for bit: the same prompt ids, pixels, weights, greedy
tokens and log probabilities. The Q8_0 pair keeps its 8-bit blocks, the tower's included, and stays
within their rounding (bounds measured on this model: image embeddings 0.8-0.9 % off in relative
norm, first-step log probabilities of the folder's top five at most 0.06 nats off).
Without its mmproj, a GGUF is the text model it is."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from ember import LLM, SamplingParams
from ember.errors import ModelLoadError
from ember.loaders import load_model_source
from ember.loaders.hf_folder import load_hf_folder
from ember.media.processing import source_image_processing
from ember.models.weights import BlockWeights
from gguf_vision import convert_pair, copy_converter, llama_cpp_source, write_convertible_smolvlm
from unit.gguf_helpers import write_gguf
from unit.gguf_models import state_dict_of, tiny_model
from vision_fixtures import conversation, picture

SIZES = ((40, 40), (150, 90), (60, 130))  # 1 tile; 2x2 tiles plus the whole; portrait

EXACT = dict(dtype="float32", quantization="none", max_model_len=1024, kv_cache_tokens=8192)
TOWER_LINEARS = ("qkv_proj", "out_proj", "fc1", "fc2")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the folder, {outtype: its language GGUF, with mmproj-*.gguf beside it}, a GGUF cache folder)."""
    source = llama_cpp_source()
    root = tmp_path_factory.mktemp("gguf_vision")
    script = copy_converter(source, root / "llama.cpp")
    folder = write_convertible_smolvlm(root / "SmolVLM-tiny")
    pairs = {outtype: convert_pair(script, folder, root / outtype.upper(), outtype)[0] for outtype in ("f16", "q8_0")}
    return folder, pairs, root / "cache"


@pytest.fixture(scope="module")
def from_folder(converted):
    return LLM(str(converted[0]), **EXACT)


def open_pair(converted, outtype: str, mmproj: str = "auto"):
    _, pairs, cache = converted
    return load_model_source(str(pairs[outtype]), cache, mmproj=mmproj)


def test_the_pair_is_found_beside_the_model_and_read_as_the_folder(converted):
    folder, pairs, _ = converted
    source = open_pair(converted, "f16")
    assert source.mmproj_path == str(pairs["f16"].parent / "mmproj-SmolVLM-tiny-F16.gguf")
    config, theirs = source.hf_config, json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "idefics3" and config["text_config"]["model_type"] == "llama"
    assert {key: config[key] for key in ("scale_factor", "image_token_id")} == \
        {key: theirs[key] for key in ("scale_factor", "image_token_id")}
    assert config["vision_config"] == {key: theirs["vision_config"][key] for key in config["vision_config"]}
    # every weight, under transformers' names: the text model's as the folder's text_model
    ours = {name if name.startswith(("model.vision_model.", "model.connector.", "lm_head.")) else
            name.replace("model.", "model.text_model.", 1): tensor for name, tensor in source.weights()}
    folder_weights = dict(load_hf_folder(folder).weights())
    assert sorted(ours) == sorted(folder_weights)
    assert all(torch.equal(ours[name], folder_weights[name]) for name in ours)


def test_the_pairs_image_preparation_is_the_folders(converted):
    pair = source_image_processing(open_pair(converted, "f16"), vision=True)
    folder = source_image_processing(load_hf_folder(converted[0]), vision=True)
    assert (pair.image_token_id, pair.image_seq_len) == (folder.image_token_id, folder.image_seq_len)
    for size in (*SIZES, (300, 17), (64, 64)):
        image = picture(*size, seed=size[0])
        assert pair.layout(*size) == folder.layout(*size)
        ours, theirs = pair.prepare(image), folder.prepare(image)
        assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)


@pytest.mark.parametrize("size", SIZES)
def test_a_float16_pair_answers_exactly_as_its_folder(converted, from_folder, size):
    pair = LLM(str(converted[1]["f16"]), cache_dir=converted[2], **EXACT)
    image = picture(*size, seed=sum(size))
    assert pair.encode_with_images(conversation(image))[0] == from_folder.encode_with_images(conversation(image))[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    ours, theirs = (llm.generate([conversation(image)], params)[0] for llm in (pair, from_folder))
    assert ours.token_ids == theirs.token_ids
    assert [lp.logprob for lp in ours.logprobs] == [lp.logprob for lp in theirs.logprobs]
    assert pair.engine.images.num_encoded == 1


def test_a_q8_0_pair_keeps_its_blocks_and_answers_within_their_rounding(converted, from_folder):
    pair = LLM(str(converted[1]["q8_0"]), cache_dir=converted[2], dtype="float32", max_model_len=1024,
               kv_cache_tokens=8192)
    model = pair.engine.images.model
    formats = {name: module.weights for name, module in model.named_modules()
               if name.startswith(("vision_model.", "connector.")) and name.endswith(TOWER_LINEARS + ("proj",))}
    assert len(formats) == 4 * 2 + 1 and all(isinstance(w, BlockWeights) and w.bits == 8 for w in formats.values())
    assert isinstance(model.model.layers[0].mlp.down_proj.weights, BlockWeights)  # the language model's too
    for size in SIZES:
        image = picture(*size, seed=sum(size))
        pixels = {name: torch.from_numpy(array) for name, array in from_folder.vision.prepare(image).items()}
        with torch.inference_mode():
            exact, rounded = from_folder.engine.images.model.encode_images(**pixels), model.encode_images(**pixels)
        assert ((rounded - exact).norm() / exact.norm()).item() < 0.02
        first = from_folder.generate([conversation(image)], SamplingParams(max_tokens=1, temperature=0.0,
                                                                           logprobs=5))[0].logprobs[0]
        ids = [token for token, _ in first.top]
        ours = pair.generate([conversation(image)], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                                                   logprob_token_ids=ids))[0].logprobs[0]
        assert ours.requested and max(abs(lp - dict(first.top)[token]) for token, lp in ours.requested) < 0.15


def test_without_its_mmproj_a_gguf_is_a_text_model(converted, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(converted[1]["f16"], alone / converted[1]["f16"].name)
    for source in (load_model_source(str(alone / converted[1]["f16"].name), converted[2], mmproj="auto"),
                   open_pair(converted, "f16", mmproj="none")):
        assert source.hf_config["model_type"] == "llama" and source.mmproj_path is None
        assert source_image_processing(source, vision=True) is None


def tiny_text_gguf(path, model_type: str = "llama", **overrides):
    model = tiny_model(model_type, **overrides)
    return write_gguf(path, model_type, model.config.to_dict(), state_dict_of(model))


def test_an_mmproj_that_is_not_the_pair_is_refused_when_named_and_left_aside_when_found(converted, tmp_path,
                                                                                          caplog):
    mmproj = converted[1]["f16"].parent / "mmproj-SmolVLM-tiny-F16.gguf"
    cache = tmp_path / "cache"
    for model, words in ((tiny_text_gguf(tmp_path / "narrow.gguf", hidden_size=32), "projects to a width of 64, "
                          "and narrow's is 32: they are not a pair"),
                         (tiny_text_gguf(tmp_path / "qwen.gguf", "qwen3"), "goes with a llama language model, "
                          "and qwen is qwen3"),
                         (tiny_text_gguf(tmp_path / "plain.gguf"), "plain's vocabulary lacks <image>, "
                          "<fake_token_around_image>, <global-img>, <row_1_col_1>")):
        with pytest.raises(ModelLoadError, match=words) as caught:
            load_model_source(str(model), cache, mmproj=str(mmproj))
        assert caught.value.param == "mmproj"
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(mmproj, beside / mmproj.name)
    with caplog.at_level(logging.WARNING, logger="ember.loaders"):
        source = load_model_source(str(tiny_text_gguf(beside / "plain.gguf")), cache, mmproj="auto")
    assert source.hf_config["model_type"] == "llama" and source.mmproj_path is None
    assert f"{mmproj.name} is left aside, so plain.gguf is served as a text model" in caplog.text


def test_an_mmproj_is_not_a_model_and_goes_with_a_gguf_only(converted, tmp_path):
    mmproj = converted[1]["q8_0"].parent / "mmproj-SmolVLM-tiny-Q8_0.gguf"
    with pytest.raises(ModelLoadError, match="is a vision model's projector .* --mmproj mmproj-SmolVLM-tiny-Q8_0"):
        load_model_source(str(mmproj), converted[2])
    with pytest.raises(ModelLoadError, match="--mmproj goes with a GGUF model") as caught:
        load_model_source(str(converted[0]), converted[2], mmproj=str(mmproj))
    assert caught.value.param == "mmproj"
    with pytest.raises(ModelLoadError, match="does not exist") as caught:
        load_model_source(str(converted[1]["q8_0"]), converted[2], mmproj=str(tmp_path / "mmproj-missing.gguf"))
    assert caught.value.param == "mmproj"
    with pytest.raises(ModelLoadError, match="is not an mmproj file") as caught:
        load_model_source(str(converted[1]["q8_0"]), converted[2], mmproj=str(converted[1]["f16"]))
    assert caught.value.param == "mmproj"


def test_a_projector_type_ember_does_not_read_is_refused_by_name(tmp_path):
    import gguf
    import numpy as np

    other = tmp_path / "mmproj-other.gguf"
    writer = gguf.GGUFWriter(str(other), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "pixtral")
    writer.add_tensor("mm.1.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="mmproj-other.gguf: its projector type is 'pixtral', and ember reads "
                                             "idefics3, gemma3") as caught:
        load_model_source(str(tiny_text_gguf(tmp_path / "plain.gguf")), tmp_path / "cache", mmproj=str(other))
    assert caught.value.param == "mmproj"


def test_the_server_takes_mmproj_as_a_flag():
    import argparse

    from ember.server.flags import add_serve_parser, build_config

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert build_config(parser.parse_args(["serve", "m.gguf"])).engine.mmproj == "auto"
    assert build_config(parser.parse_args(["serve", "m.gguf", "--mmproj", "p.gguf"])).engine.mmproj == "p.gguf"
