"""Images through the engine on a tiny random SmolVLM folder (transformers' own config, image
processor and model; the default model's tokenizer with SmolVLM's image tokens), against
transformers in float32: the prompt ids its processor makes, the greedy tokens and log
probabilities of its model, through whole and chunked prefill; then what the engine promises
beside: one encoding per image, the prefix cache keyed by the image, batch invariance, no leaks."""

from __future__ import annotations

import io

import pytest
import torch
import transformers
from PIL import Image

from ember import LLM, SamplingParams
from vision_fixtures import add_random_weights, conversation, image_bytes, picture, write_smolvlm_folder

SIZES = ((40, 40), (150, 90), (60, 130))  # 1 tile; 2x2 tiles plus the whole; portrait


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return add_random_weights(write_smolvlm_folder(tmp_path_factory.mktemp("smolvlm") / "model"))


@pytest.fixture(scope="module")
def reference(folder):
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    # SmolVLM's own processor class also builds a video processor, which needs torchvision; Idefics3's
    # writes the same image prompt (get_image_prompt_string) around SmolVLM's image processor
    processor = transformers.Idefics3Processor(image_processor=SmolVLMImageProcessorPil.from_pretrained(folder),
                                               tokenizer=tokenizer, image_seq_len=4, chat_template=tokenizer.chat_template)
    return model, processor


@pytest.fixture(scope="module")
def exact(folder):
    llm = LLM(str(folder), dtype="float32", quantization="none", max_model_len=1024, kv_cache_tokens=8192)
    yield llm
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()


def reference_run(reference, image: bytes, max_new_tokens: int) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, greedy tokens, each step's log probabilities (steps, vocab)) from transformers."""
    model, processor = reference
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, min_new_tokens=max_new_tokens)
    prompt = inputs["input_ids"][0].tolist()
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)
    return prompt, out.sequences[0, len(prompt):].tolist(), logprobs


@pytest.mark.parametrize("size", SIZES)
def test_prompt_tokens_and_logprobs_equal_transformers(exact, reference, size):
    image = picture(*size, seed=sum(size))
    prompt, tokens, logprobs = reference_run(reference, image, max_new_tokens=6)
    ids, media = exact.encode_with_images(conversation(image))
    assert ids == prompt
    assert len(media) == 1 and media[0].stop - media[0].start <= len(prompt)
    out = exact.generate([conversation(image)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                              logprobs=0))[0]
    assert out.token_ids == tokens
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    theirs = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=2e-4), (ours, theirs)


def test_a_chunk_boundary_inside_an_image_changes_nothing(folder):
    """A step budget of 16 tokens cuts the image's spans into many chunks."""
    image = picture(150, 90, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    whole = LLM(str(folder), dtype="float32", quantization="none", max_model_len=1024, kv_cache_tokens=8192,
                enable_prefix_caching=False)
    chunked = LLM(str(folder), dtype="float32", quantization="none", max_model_len=1024, kv_cache_tokens=8192,
                  enable_prefix_caching=False, max_num_batched_tokens=16)
    a, b = (llm.generate([conversation(image)], params)[0] for llm in (whole, chunked))
    assert a.token_ids == b.token_ids
    assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-5)


def test_an_image_is_encoded_once_and_its_blocks_are_reused(exact):
    images = exact.engine.images
    image, other = picture(150, 90, seed=11), picture(150, 90, seed=12)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    before = images.num_encoded
    first = exact.generate([conversation(image)], params)[0]
    again = exact.generate([conversation(image)], params)[0]
    assert images.num_encoded == before + 1  # the second found it cached
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16 and again.token_ids == first.token_ids
    changed = exact.generate([conversation(other)], params)[0]
    ids, media = exact.encode_with_images(conversation(other))
    assert changed.num_cached_tokens <= media[0].start  # the same tokens beside another image are other KV
    assert images.num_encoded == before + 2
    # two requests bringing one new image at once share its encoding
    twins = exact.generate([conversation(picture(40, 40, seed=13)), conversation(picture(40, 40, seed=13), text="Hi?")],
                           params)
    assert images.num_encoded == before + 3 and all(t.token_ids for t in twins)


def test_an_image_request_has_the_same_bits_alone_and_in_a_batch(folder):
    """bfloat16, ember's CPU kernels, batch-invariant row plans: the promise covers images."""
    llm = LLM(str(folder), max_model_len=1024, kv_cache_tokens=8192, enable_prefix_caching=False)
    image = picture(150, 90, seed=21)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    alone = llm.generate([conversation(image)], params)[0]
    batched = llm.generate([conversation(picture(60, 130, seed=22)), conversation(image),
                            [{"role": "user", "content": "Tell me about the sea."}]], params)[1]
    assert alone.token_ids == batched.token_ids
    assert [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in batched.logprobs]
    llm.engine.check_invariants()
    assert llm.engine.images.stats()["image_cache_bytes"] > 0  # kept for the next request, within its budget


def test_a_text_model_refuses_images(llm):
    from ember.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as refused:
        llm.generate([conversation(image_bytes(8, 8))], SamplingParams(max_tokens=2))
    assert refused.value.code == "vision_disabled"
