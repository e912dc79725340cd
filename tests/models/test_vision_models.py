"""SmolVLM, Idefics3 and Gemma 3 with images at tiny random configs against transformers, in float32:
the image embeddings of real image-processor outputs, then the logits of prompts with the images
spliced in (whole prefill, chunked prefill, decode steps); bfloat16 close; tiles independent."""

from __future__ import annotations

import pytest
import torch
from model_builders import assert_logits_close
from reference_attention import ReferenceAttention
from vision_builders import (CASES, IMAGE_SIZES, IMAGE_TOKEN, Prompt, build_prompt, load_ember, process_image,
                             random_image, reference_model, save_folder)

from ember.models import gemma3, get_model_class, idefics3


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(case):
    return reference_model(case)


@pytest.fixture(scope="module")
def folder(case, reference, tmp_path_factory):
    return save_folder(reference, tmp_path_factory.mktemp(case))


@pytest.fixture(scope="module")
def ember(folder):
    return load_ember(folder)


def reference_image_features(case: str, hf_model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if case == "gemma3":
        features = hf_model.get_image_features(inputs["pixel_values"]).pooler_output
    else:
        features = hf_model.get_image_features(inputs["pixel_values"][None],
                                               inputs["pixel_attention_mask"][None]).pooler_output[0]
    return features.reshape(-1, features.shape[-1])


def image_embeds(model, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, values) for the whole prompt: every image encoded on its own, in prompt order."""
    rows = torch.nonzero(prompt.ids == IMAGE_TOKEN).squeeze(1)
    values = torch.cat([model.encode_images(**image.inputs) for image in prompt.images])
    assert values.shape == (rows.shape[0], model.config.hidden_size)
    return rows, values


def attention_for(model, config, prompt: Prompt) -> ReferenceAttention:
    """Causal attention, and among one image's tokens both ways where the model asks for it."""
    groups = prompt.image_groups() if model.images_attend_bidirectionally else None
    return ReferenceAttention(config.layer_windows, groups)


def run(model, attn: ReferenceAttention, ids: torch.Tensor, start: int,
        embeds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[0])
    attn.set_positions(positions)
    return model.compute_logits(model(ids, positions, attn, embeds))


def chunk_embeds(embeds: tuple[torch.Tensor, torch.Tensor], start: int, end: int):
    """The image rows inside [start, end), as the chunk's own rows: a slice of an image when the
    chunk covers only part of it."""
    rows, values = embeds
    inside = (rows >= start) & (rows < end)
    return (rows[inside] - start, values[inside]) if inside.any() else None


def test_registration():
    assert get_model_class("idefics3") is idefics3.Model
    assert get_model_class("smolvlm") is idefics3.Model
    assert get_model_class("gemma3") is gemma3.Model


def original_release_names(name: str) -> str:
    """Gemma 3's names as google's first checkpoints wrote them (llava's layout)."""
    for old, new in (("model.language_model.", "language_model.model."),
                     ("model.vision_tower.", "vision_tower.vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def test_every_checkpoint_layout_loads_the_same_weights(case, reference, ember):
    """transformers' names in memory, as save_pretrained wrote them (the folder ember loaded), and,
    for Gemma 3, the original release's."""
    loaded, config = ember
    layouts = [dict(reference.state_dict())]
    if case == "gemma3":
        layouts.append({original_release_names(k): v for k, v in reference.state_dict().items()})
        assert any(k.startswith("vision_tower.vision_model.") for k in layouts[-1])
    expected = dict(loaded.named_parameters())
    for weights in layouts:
        model = get_model_class(config.model_type)(config)
        model.load_weights(weights.items())
        for name, param in model.named_parameters():
            assert torch.equal(param, expected[name]), name


@torch.inference_mode()
def test_encode_images_matches_transformers(case, reference, ember):
    model, _ = ember
    for seed, (width, height) in enumerate(IMAGE_SIZES):
        image = process_image(case, random_image(width, height, seed), model.image_seq_len)
        ours = model.encode_images(**image.inputs)
        tiles = image.inputs["pixel_values"].shape[0]
        assert ours.shape == (tiles * model.image_seq_len, model.config.hidden_size)
        assert ours.shape[0] == sum(token == IMAGE_TOKEN for token in image.placeholder)
        assert_logits_close(ours, reference_image_features(case, reference, image.inputs), f"{case} image")


@torch.inference_mode()
@pytest.mark.parametrize("case", ["idefics3", "smolvlm"], indirect=True)
def test_tiles_padded_in_part_match_transformers(case, reference, ember):
    """Idefics3's tiles whose real pixels cover only part of them (as the processor pads images of
    a batch to one size): patch positions from the pixel mask, padding patches masked as keys."""
    model, _ = ember
    image = process_image(case, random_image(100, 60, 0), model.image_seq_len)
    pixels, mask = image.inputs["pixel_values"].clone(), image.inputs["pixel_attention_mask"].clone()
    for tile, (height, width) in enumerate([(13, 30), (32, 7), (21, 21)]):
        mask[tile], pixels[tile] = 0, torch.where(mask[tile].bool(), pixels[tile], 0.0)
        mask[tile, :height, :width] = 1
        pixels[tile, :, height:, :] = pixels[tile, :, :, width:] = 0.0
    inputs = {"pixel_values": pixels, "pixel_attention_mask": mask}
    assert_logits_close(model.encode_images(**inputs), reference_image_features(case, reference, inputs),
                        f"{case} image")


@torch.inference_mode()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiles_do_not_depend_on_each_other(case, folder, dtype):
    """An image's tiles encoded together give the bits of each tile encoded alone."""
    model, _ = load_ember(folder, dtype)
    image = process_image(case, random_image(100, 60, 3), model.image_seq_len)
    together = model.encode_images(**image.inputs)
    alone = torch.cat([model.encode_images(**{k: v[i:i + 1] for k, v in image.inputs.items()})
                       for i in range(image.inputs["pixel_values"].shape[0])])
    assert torch.equal(together, alone)


def reference_logits(case: str, hf_model, prompt: Prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(**prompt.reference_inputs(case)).logits[0].float()


def prompt_for(case: str, model) -> Prompt:
    images = [random_image(100, 60, 1), random_image(30, 50, 2)]
    return build_prompt(case, images, model.image_seq_len)


@torch.inference_mode()
@pytest.mark.parametrize("fused", [False, True], ids=["torch-ops", "fused-kernels"])
def test_prefill_with_images_then_decode_matches_transformers(case, reference, folder, fused):
    model, config = load_ember(folder, fused=fused)
    prompt = prompt_for(case, model)
    ref = reference_logits(case, reference, prompt)
    prefill = prompt.ids.shape[0] - 3  # the last three tokens (text) decode one at a time
    attn = attention_for(model, config, prompt)
    embeds = image_embeds(model, prompt)
    assert_logits_close(run(model, attn, prompt.ids[:prefill], 0, embeds), ref[:prefill], f"{case} images")
    for t in range(prefill, prompt.ids.shape[0]):
        assert_logits_close(run(model, attn, prompt.ids[t:t + 1], t, None), ref[t:t + 1], f"{case} images")


@torch.inference_mode()
def test_chunked_prefill_with_images_matches_transformers(case, reference, ember):
    """Chunks that cut an image: each carries its slice of the image's embeddings. Gemma 3's image
    tokens attend to each other both ways, so there no chunk ends inside an image's tokens."""
    model, config = ember
    prompt = prompt_for(case, model)
    ref = reference_logits(case, reference, prompt)
    embeds = image_embeds(model, prompt)
    length = prompt.ids.shape[0]
    attn = attention_for(model, config, prompt)
    if model.images_attend_bidirectionally:  # before the second image, after it, then in the text
        second_end = prompt.starts[1] + len(prompt.images[1].placeholder)
        bounds = [0, prompt.starts[1], second_end + 2, length]
    else:
        first = prompt.starts[0]
        bounds = [0, first + 7, first + 7 + model.image_seq_len + 2, prompt.starts[1] + 1, length]
    for start, end in zip(bounds, bounds[1:]):
        logits = run(model, attn, prompt.ids[start:end], start, chunk_embeds(embeds, start, end))
        assert_logits_close(logits, ref[start:end], f"{case} images")


def cached_prefix(attn: ReferenceAttention, length: int) -> ReferenceAttention:
    """A fresh attention holding attn's keys and values of the positions before `length`, as a
    prefix-cache hit hands them to a new request."""
    hit = ReferenceAttention(attn.windows, attn.image_groups)
    for layer, positions in attn.key_positions.items():
        keep = positions < length
        hit.keys[layer], hit.values[layer] = attn.keys[layer][keep], attn.values[layer][keep]
        hit.key_positions[layer] = positions[keep]
    return hit


@torch.inference_mode()
def test_prefix_cache_hit_ending_inside_an_image_matches_transformers(case, reference, ember):
    """A cached prefix that ends inside an image (its keys computed in a forward that held the
    whole image), then the rest of the prompt with the rest of the image's embeddings."""
    model, config = ember
    prompt = prompt_for(case, model)
    ref = reference_logits(case, reference, prompt)
    embeds = image_embeds(model, prompt)
    length = prompt.ids.shape[0]
    first = attention_for(model, config, prompt)
    run(model, first, prompt.ids, 0, embeds)
    cut = prompt.starts[1] + 5  # inside the second image's first run of image tokens
    assert prompt.ids[cut - 1] == prompt.ids[cut] == IMAGE_TOKEN
    logits = run(model, cached_prefix(first, cut), prompt.ids[cut:], cut, chunk_embeds(embeds, cut, length))
    assert_logits_close(logits, ref[cut:], f"{case} images")


@torch.inference_mode()
@pytest.mark.parametrize("case", ["gemma3"], indirect=True)
def test_gemma3_image_tokens_attend_both_ways(case, reference, ember):
    """Causal attention alone over Gemma 3's image tokens is not transformers' model: the engine must
    give one image's tokens each other's keys in prefill (see attention_for)."""
    model, config = ember
    prompt = prompt_for(case, model)
    ref = reference_logits(case, reference, prompt)
    causal = run(model, ReferenceAttention(config.layer_windows), prompt.ids, 0, image_embeds(model, prompt))
    assert (causal - ref).abs().max() > 1e-2 * ref.abs().max()


@torch.inference_mode()
def test_text_only_prompts_match_transformers(case, reference, ember):
    model, config = ember
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = reference(input_ids=ids[None]).logits[0].float()
    logits = run(model, ReferenceAttention(config.layer_windows), ids, 0, None)
    assert_logits_close(logits, ref, f"{case} text")


@torch.inference_mode()
def test_bfloat16_with_images_is_close(case, reference, folder):
    model, config = load_ember(folder, "bfloat16")
    prompt = prompt_for(case, model)
    ref = reference_logits(case, reference, prompt)
    rows, values = image_embeds(model, prompt)
    assert values.dtype == torch.bfloat16
    logits = run(model, attention_for(model, config, prompt), prompt.ids, 0, (rows, values))
    assert_logits_close(logits, ref, f"{case} images bfloat16", tol=5e-2)
