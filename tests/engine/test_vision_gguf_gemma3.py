"""Gemma 3 as llama.cpp ships it: a tiny random Gemma 3 folder converted by llama.cpp's own converter
(tests/gguf_vision.py) into the language GGUF and its gemma3 mmproj, in float16. The pair holds the
folder's weights exactly (they are float16 values; the converter's +1 on the soft embedding norm is
undone), so ember's answers from it equal its answers from the folder bit for bit: the same config,
weights, prompt ids, pixels, greedy tokens and log probabilities. The gemma3 mmproj goes with a
Gemma 3 language model only, and its pooling comes from the file or clip.cpp's default."""

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
from gguf_vision import convert_pair, copy_converter, llama_cpp_source, write_convertible_gemma3
from unit.gguf_helpers import write_gguf
from unit.gguf_models import state_dict_of, tiny_model
from vision_fixtures import GEMMA3_TOKENS_PER_IMAGE, conversation, picture

EXACT = dict(dtype="float32", quantization="none", max_model_len=1024, kv_cache_tokens=4096)
SIZES = ((32, 32), (150, 90), (60, 130))  # the tower's own size; landscape; portrait


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the folder, its language GGUF with mmproj-*.gguf beside it, its mmproj, a GGUF cache folder)."""
    root = tmp_path_factory.mktemp("gguf_gemma3")
    script = copy_converter(llama_cpp_source(), root / "llama.cpp")
    folder = write_convertible_gemma3(root / "gemma3-tiny")
    language, mmproj = convert_pair(script, folder, root / "F16", "f16")
    return folder, language, mmproj, root / "cache"


def open_pair(converted, mmproj: str = "auto"):
    _, language, _, cache = converted
    return load_model_source(str(language), cache, mmproj=mmproj)


def test_the_pair_is_found_beside_the_model_and_read_as_the_folder(converted):
    folder, _, mmproj, _ = converted
    source = open_pair(converted)
    assert source.mmproj_path == str(mmproj)
    config, theirs = source.hf_config, json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["text_config"]["model_type"] == "gemma3_text"
    assert config["mm_tokens_per_image"] == theirs["mm_tokens_per_image"] == GEMMA3_TOKENS_PER_IMAGE
    assert config["image_token_index"] == theirs["image_token_index"]
    assert config["vision_config"] == {key: theirs["vision_config"][key] for key in config["vision_config"]}
    # every weight under transformers' names, the text model's as the folder's language_model
    ours = {name if name.startswith(("vision_tower.", "multi_modal_projector.")) else
            name.replace("model.", "language_model.model.", 1): tensor for name, tensor in source.weights()}
    folder_weights = dict(load_hf_folder(folder).weights())
    assert sorted(ours) == sorted(folder_weights)
    assert all(torch.equal(ours[name], folder_weights[name]) for name in ours)


def test_the_pairs_image_preparation_is_the_folders(converted):
    pair = source_image_processing(open_pair(converted), vision=True)
    folder = source_image_processing(load_hf_folder(converted[0]), vision=True)
    assert (pair.image_token_id, pair.num_tokens) == (folder.image_token_id, folder.num_tokens)
    for size in (*SIZES, (300, 17)):
        image = picture(*size, seed=size[0])
        assert pair.layout(*size) == folder.layout(*size)
        ours, theirs = pair.prepare(image), folder.prepare(image)
        assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)


def test_a_float16_pair_answers_exactly_as_its_folder(converted):
    from_folder = LLM(str(converted[0]), **EXACT)
    pair = LLM(str(converted[1]), cache_dir=converted[3], **EXACT)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    replies = []
    for size in SIZES:
        image = picture(*size, seed=sum(size))
        prompt = pair.encode_with_images(conversation(image))[0]
        assert prompt == from_folder.encode_with_images(conversation(image))[0]
        ours, theirs = (llm.generate([conversation(image)], params)[0] for llm in (pair, from_folder))
        assert ours.token_ids == theirs.token_ids
        assert [lp.logprob for lp in ours.logprobs] == [lp.logprob for lp in theirs.logprobs]
        replies.append([lp.logprob for lp in ours.logprobs])
    assert pair.engine.images.num_encoded == len(SIZES)
    assert len({tuple(reply) for reply in replies}) == len(SIZES)  # each reply reads its image
    pair.close()
    from_folder.close()


def tiny_llama_gguf(path):
    model = tiny_model("llama")
    return write_gguf(path, "llama", model.config.to_dict(), state_dict_of(model))


def test_the_gemma3_mmproj_with_another_language_model_is_refused_by_name(converted, tmp_path, caplog):
    mmproj, cache = converted[2], tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=f"{mmproj.name} \\(gemma3\\) goes with a gemma3_text language model, "
                                             "and plain is llama") as caught:
        load_model_source(str(tiny_llama_gguf(tmp_path / "plain.gguf")), cache, mmproj=str(mmproj))
    assert caught.value.param == "mmproj"
    beside = tmp_path / "beside"
    beside.mkdir()
    shutil.copy(mmproj, beside / mmproj.name)
    with caplog.at_level(logging.WARNING, logger="ember.loaders"):
        source = load_model_source(str(tiny_llama_gguf(beside / "plain.gguf")), cache, mmproj="auto")
    assert source.hf_config["model_type"] == "llama" and source.mmproj_path is None
    assert f"{mmproj.name} is left aside, so plain.gguf is served as a text model" in caplog.text


def write_gemma3_mmproj(path, scale_factor: int | None):
    """An mmproj holding only the metadata a gemma3 projector's settings are read from (a 32-pixel
    image of 4-pixel patches: 8 x 8 patches), and a projection to the tiny folder's width."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_string("clip.projector_type", "gemma3")
    for key, value in (("projection_dim", 64), ("image_size", 32), ("patch_size", 4), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("block_count", 1), ("attention.head_count", 2)):
        writer.add_uint32(f"clip.vision.{key}", value)
    for key in ("image_mean", "image_std"):
        writer.add_array(f"clip.vision.{key}", [0.5, 0.5, 0.5])
    if scale_factor is not None:
        writer.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    writer.add_tensor("mm.input_projection.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gemma3_mmproj_pools_as_it_says_or_as_clip_cpp_does_without_a_word(converted, tmp_path):
    unsaid = write_gemma3_mmproj(tmp_path / "mmproj-unsaid.gguf", None)
    assert open_pair(converted, str(unsaid)).hf_config["mm_tokens_per_image"] == 4  # 8 x 8 patches pooled 4 to 1
    uneven = write_gemma3_mmproj(tmp_path / "mmproj-uneven.gguf", 3)
    with pytest.raises(ModelLoadError, match="mmproj-uneven.gguf: its scale factor 3 does not pool the tower's "
                                             "8 x 8 patches evenly") as caught:
        open_pair(converted, str(uneven))
    assert caught.value.param == "mmproj"
