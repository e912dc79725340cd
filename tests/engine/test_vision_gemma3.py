"""Gemma 3's images through the engine on a tiny random folder (transformers' own config, image
processor and model; the default model's tokenizer with Gemma 3's image tokens), against
transformers in float32: the prompt ids its Gemma3Processor makes, the greedy tokens and log
probabilities of its model, where one image's tokens attend to each other both ways in prefill,
through whole prefill, chunks that an image's run would cut, a batch, a prefix-cache hit that ends
inside an image, and preemption."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from ember import LLM, SamplingParams
from ember.engine.images import consecutive_runs
from vision_fixtures import GEMMA3_TOKENS_PER_IMAGE, conversation, picture, write_gemma3_folder

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
ATOL = 2e-4  # float32: ember's kernels and transformers' sum in other orders


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_gemma3_folder(tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(folder),
                                             tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                             image_seq_length=GEMMA3_TOKENS_PER_IMAGE)
    return model, processor


def gemma3_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), **{"dtype": "float32", "quantization": "none", "max_model_len": 1024,
                               "kv_cache_tokens": 4096, **kwargs})


@pytest.fixture(scope="module")
def exact(folder):
    llm = gemma3_llm(folder)
    yield llm
    assert not llm.engine.has_unfinished()
    llm.engine.check_invariants()


def reference_run(reference, messages: list[dict], bidirectional: bool = True):
    """(prompt ids, greedy tokens, their log probabilities) from transformers' generate; without
    `bidirectional` (no token_type_ids), its image tokens attend causally."""
    model, processor = reference
    text = processor.apply_chat_template([{"role": m["role"], "content": [
        {"type": "image"} if part["type"] == "image" else part for part in m["content"]]} for m in messages],
        add_generation_prompt=True)
    images = [Image.open(io.BytesIO(part["image"])).convert("RGB")
              for m in messages for part in m["content"] if part["type"] == "image"]
    inputs = processor(text=text, images=[images], return_tensors="pt")
    if not bidirectional:
        del inputs["token_type_ids"]
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=PARAMS.max_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, min_new_tokens=PARAMS.max_tokens)
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)
    return prompt, tokens, logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def assert_same_as_transformers(out, expected) -> None:
    _, tokens, logprobs = expected
    assert out.token_ids == tokens
    ours = torch.tensor([lp.logprob for lp in out.logprobs])
    assert torch.allclose(ours, logprobs, atol=ATOL), (ours, logprobs)


ONE_IMAGE = conversation(picture(50, 40, seed=1))
TWO_IMAGES = conversation(picture(30, 70, seed=2), picture(64, 64, seed=3), text="Which one is brighter?")


@pytest.fixture(scope="module")
def expected(reference):
    return {name: reference_run(reference, messages) for name, messages in
            (("one", ONE_IMAGE), ("two", TWO_IMAGES))}


def test_image_runs_are_the_maximal_stretches_of_image_positions():
    """transformers' groups: each image, and each pan-and-scan crop, a run of its own."""
    assert consecutive_runs(np.array([5, 6, 7, 10, 11, 20])) == [(5, 8), (10, 12), (20, 21)]
    assert consecutive_runs(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("name", ["one", "two"])
def test_prompt_ids_tokens_and_logprobs_equal_transformers(exact, expected, name):
    messages = ONE_IMAGE if name == "one" else TWO_IMAGES
    ids, media = exact.encode_with_images(messages)
    assert ids == expected[name][0]
    assert [m.stop - m.start for m in media] == [GEMMA3_TOKENS_PER_IMAGE] * len(media)
    assert not exact.engine.uses_cpu_kernels  # the attention kernel is causal only: the torch path
    assert_same_as_transformers(exact.generate([messages], PARAMS)[0], expected[name])


def test_the_tokens_differ_where_images_attend_causally(reference, expected):
    """What the tests above tell apart: transformers' own model with causal image tokens."""
    causal = reference_run(reference, ONE_IMAGE, bidirectional=False)
    assert (causal[2] - expected["one"][2]).abs().max() > 50 * ATOL


def bits(out) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in out.logprobs]


OTHER_QUESTION = conversation(ONE_IMAGE[0]["content"][0]["image"], text="Describe it.")


@pytest.fixture(scope="module")
def cold(exact):
    """Each prompt's output from an empty prefix cache, whole prompts in one chunk."""
    outputs = {}
    for name, messages in (("one", ONE_IMAGE), ("two", TWO_IMAGES), ("other", OTHER_QUESTION)):
        exact.engine.kv_manager.reset_prefix_cache()
        outputs[name] = exact.generate([messages], PARAMS)[0]
    exact.engine.kv_manager.reset_prefix_cache()
    return outputs


@pytest.mark.parametrize("budget, batch_invariant", [(16, True), (13, False)], ids=["exact", "fast"])
def test_chunks_that_would_cut_an_image_match_transformers(folder, expected, cold, budget, batch_invariant):
    """Chunks of at most 16 tokens: a chunk ends before a run of image tokens, and the next covers
    it whole (past the budget on the fast path's 13); through the batch-invariant attention path's
    fixed tiles (the same bits as one whole chunk) and the fast one."""
    llm = gemma3_llm(folder, max_num_batched_tokens=budget, enable_prefix_caching=False,
                     batch_invariant=batch_invariant)
    assert llm.engine.invariance.holds == batch_invariant, llm.engine.invariance.reason
    for messages, name in ((ONE_IMAGE, "one"), (TWO_IMAGES, "two")):
        out = llm.generate([messages], PARAMS)[0]
        assert_same_as_transformers(out, expected[name])
        if batch_invariant:
            assert bits(out) == bits(cold[name])
    llm.engine.check_invariants()


def test_an_image_alone_and_in_a_batch_matches_transformers(folder, expected):
    llm = gemma3_llm(folder, enable_prefix_caching=False, max_num_batched_tokens=40)
    alone = llm.generate([ONE_IMAGE], PARAMS)[0]
    batch = llm.generate([TWO_IMAGES, [{"role": "user", "content": "Tell me about the sea."}], ONE_IMAGE], PARAMS)
    for out in (alone, batch[2]):
        assert_same_as_transformers(out, expected["one"])
    assert_same_as_transformers(batch[0], expected["two"])
    llm.engine.check_invariants()


def test_a_prefix_cache_hit_ending_inside_an_image_matches_a_cold_run(exact, reference, cold):
    """The second prompt shares the first's tokens up to its image's end, but not the block after:
    its cached prefix ends inside the image's run, whose keys were computed with the whole image,
    and its first chunk covers the rest of the run."""
    exact.engine.kv_manager.reset_prefix_cache()
    exact.generate([ONE_IMAGE], PARAMS)
    _, media = exact.encode_with_images(OTHER_QUESTION)
    out = exact.generate([OTHER_QUESTION], PARAMS)[0]
    assert media[0].start < out.num_cached_tokens < media[0].stop
    assert bits(out) == bits(cold["other"])
    assert_same_as_transformers(out, reference_run(reference, OTHER_QUESTION))


def test_preempted_image_requests_recompute_their_images_right(folder, cold):
    """A cache too small for the batch: requests are preempted and their prompts, images included,
    computed again (the prefix cache may hand back blocks that end inside an image)."""
    llm = gemma3_llm(folder, kv_cache_tokens=128)
    prompts = [TWO_IMAGES, ONE_IMAGE, OTHER_QUESTION, TWO_IMAGES]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for out, name in zip(outs, ("two", "one", "other", "two")):
        # a token decoded, then recomputed in a prefill, may differ in its last bits
        assert out.token_ids[:PARAMS.max_tokens] == cold[name].token_ids
        ours = torch.tensor([lp.logprob for lp in out.logprobs[:PARAMS.max_tokens]])
        assert torch.allclose(ours, torch.tensor([lp.logprob for lp in cold[name].logprobs]), atol=ATOL)
    llm.engine.check_invariants()


def test_an_image_request_has_the_same_bits_alone_and_in_a_batch(folder):
    """bfloat16 on the torch attention path, batch-invariant: the promise covers Gemma 3's images."""
    llm = LLM(str(folder), max_model_len=1024, kv_cache_tokens=4096, enable_prefix_caching=False)
    assert llm.engine.invariance.holds, llm.engine.invariance.reason
    alone = llm.generate([ONE_IMAGE], PARAMS)[0]
    batched = llm.generate([TWO_IMAGES, ONE_IMAGE, [{"role": "user", "content": "Tell me about the sea."}]], PARAMS)[1]
    assert alone.token_ids == batched.token_ids
    assert [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in batched.logprobs]
    llm.engine.check_invariants()


def test_with_images_off_gemma3_keeps_the_attention_kernel(folder):
    assert gemma3_llm(folder, vision=False).engine.uses_cpu_kernels
