"""Images on the CPU: ember against transformers in one run, at real towers' shapes with random weights.

    python bench/vision.py [--rounds 3] [--only encode-smolvlm,encode-gemma3,ttft,streams] [--streams 4]
                           [--quantization auto,int8]

- encode-smolvlm, encode-gemma3: the time to encode one image, at SmolVLM-256M's tower shape (SigLIP
  base, 512-pixel tiles of 16-pixel patches; a 1024x1024 image: 2x2 tiles and the whole, five tiles)
  and at Gemma 3 4B's (SigLIP so400m, one 896-pixel view of 14-pixel patches): ember's encode_images
  in its defaults (bfloat16, its weight formats) against transformers' get_image_features in its own
  (float32), rounds alternating, the median of each; once per --quantization (auto: the checkpoint's
  bfloat16; int8: the tower's linear layers in ember's 8-bit blocks, as a Q8_0 mmproj gives them).
- ttft: a SmolVLM-256M-shaped model (its text model too): the time to the first token of a one-image
  chat request, ember's LLM against transformers' generate of one token.
- streams: N text streams decode; then an image request arrives and is encoded beside them. The
  streams' time between tokens while the image is encoded, against before it came (ember's engine
  spends at most engine.core.IMAGE_WORK_SHARE of a decoding step on images).

Random weights are drawn so activations stay near unit scale; the speeds do not depend on them.
Nothing is downloaded: the tokenizer is the default model's with SmolVLM's image tokens
(tests/vision_fixtures.py).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SMOLVLM_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      image_size=512, patch_size=16)
SMOLVLM_TEXT = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
GEMMA3_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     image_size=896, patch_size=14, vision_use_head=False)
GEMMA3_TEXT = dict(hidden_size=2560, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, vocab_size=262208)  # a stand-in: the tower is timed


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5)
    return model.eval()


def smolvlm_folder(parent: Path, text: dict) -> Path:
    """A SmolVLM folder (vision config SmolVLM-256M's) with `text` as its text config, random weights."""
    from vision_fixtures import add_random_weights, write_smolvlm_folder

    folder = write_smolvlm_folder(parent / "smolvlm", image_size=512, patch_size=16, scale_factor=4,
                                  longest_edge=1024, text_config=text, vision_config=SMOLVLM_VISION)
    return add_random_weights(folder)


def gemma3_folder(parent: Path) -> Path:
    folder = parent / "gemma3"
    config = transformers.Gemma3Config(text_config=GEMMA3_TEXT, vision_config=GEMMA3_VISION, mm_tokens_per_image=256)
    torch.manual_seed(0)
    randomize(transformers.Gemma3ForConditionalGeneration(config).float()).save_pretrained(folder)
    from vision_fixtures import smolvlm_tokenizer

    smolvlm_tokenizer().save(folder)  # any tokenizer: only the tower runs
    return folder


def noise(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def encode(kind: str, parent: Path, rounds: int, quantization: str) -> None:
    from ember.config import EngineConfig
    from ember.engine.loading import load_model
    from ember.loaders.hf_folder import load_hf_folder

    if kind == "smolvlm":
        folder = smolvlm_folder(parent, {"num_hidden_layers": 1})
        reference = transformers.SmolVLMForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        inputs = SmolVLMImageProcessorPil.from_pretrained(folder)(images=[[noise(1024, 1024)]], return_tensors="pt")
        theirs = lambda: reference.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
        ours_inputs = {"pixel_values": inputs["pixel_values"][0], "pixel_attention_mask": inputs["pixel_attention_mask"][0]}
        label = "SmolVLM-256M tower, 1024x1024 image (5 tiles of 512)"
    else:
        folder = gemma3_folder(parent)
        reference = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        pixels = torch.rand(1, 3, 896, 896) * 2 - 1
        theirs = lambda: reference.get_image_features(pixels)
        ours_inputs = {"pixel_values": pixels}
        label = "Gemma 3 4B tower, one 896x896 view"
    model = load_model(load_hf_folder(folder), EngineConfig(quantization=quantization)).model
    with torch.inference_mode():
        model.encode_images(**ours_inputs)  # the first call builds what it caches
        theirs()
        ember_times, their_times = [], []
        for _ in range(rounds):
            ember_times.append(median_seconds(lambda: model.encode_images(**ours_inputs), 1))
            their_times.append(median_seconds(theirs, 1))
    ember_s, their_s = statistics.median(ember_times), statistics.median(their_times)
    print(f"encode, {label}, ember {quantization}: ember {ember_s:.2f} s, transformers {their_s:.2f} s: {their_s / ember_s:.2f}x faster "
          f"(rounds: ember {', '.join(f'{t:.2f}' for t in ember_times)}; transformers "
          f"{', '.join(f'{t:.2f}' for t in their_times)})", flush=True)


def ttft(parent: Path, rounds: int) -> None:
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from ember import LLM, SamplingParams

    folder = smolvlm_folder(parent, SMOLVLM_TEXT)
    image = noise(1024, 1024)
    llm = LLM(str(folder), max_model_len=4096, enable_prefix_caching=False)
    reference = transformers.SmolVLMForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.Idefics3Processor(image_processor=SmolVLMImageProcessorPil.from_pretrained(folder),
                                               tokenizer=tokenizer, image_seq_len=64,
                                               chat_template=tokenizer.chat_template)
    conversation = [{"role": "user", "content": [{"type": "image", "image": png(image)},
                                                 {"type": "text", "text": "Describe the picture."}]}]
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe the picture."}]}], add_generation_prompt=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def theirs():
        inputs = processor(text=text, images=[[image]], return_tensors="pt")
        with torch.inference_mode():
            reference.generate(**inputs, max_new_tokens=1, do_sample=False)

    def ours():
        llm.engine.images._images.clear()  # no help from the image cache between rounds
        llm.engine.images._idle.clear()
        llm.generate([conversation], params)

    ours(), theirs()
    ember_times = [median_seconds(ours, 1) for _ in range(rounds)]
    their_times = [median_seconds(theirs, 1) for _ in range(rounds)]
    ember_s, their_s = statistics.median(ember_times), statistics.median(their_times)
    print(f"time to first token, SmolVLM-256M shapes, a 1024x1024 image ({len(llm.encode_prompt(conversation))} "
          f"prompt tokens): ember {ember_s:.2f} s, transformers {their_s:.2f} s: {their_s / ember_s:.2f}x faster",
          flush=True)


def streams(parent: Path, count: int) -> None:
    from ember import LLM, SamplingParams
    from ember.engine.messages import Add

    folder = smolvlm_folder(parent, SMOLVLM_TEXT)
    llm = LLM(str(folder), max_model_len=4096, enable_prefix_caching=False)
    core, driver = llm.engine, llm.driver
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    for i in range(count):
        ids = llm.encode_prompt([{"role": "user", "content": f"Tell me a long story, number {i}."}])
        driver.admit(Add(f"stream-{i}", ids, long))
    while core.scheduler.num_prefilling or core.scheduler.num_waiting:
        driver.step()

    before = []
    for _ in range(30):
        began = time.perf_counter()
        driver.step()
        before.append(time.perf_counter() - began)
    ids, media = llm.encode_with_images([{"role": "user", "content": [{"type": "image", "image": png(noise(1024, 1024))},
                                                                       {"type": "text", "text": "Describe it."}]}])
    driver.admit(Add("image", ids, SamplingParams(max_tokens=1, temperature=0.0), media=media))
    during = []
    while "image" in core.scheduler.requests:
        began = time.perf_counter()
        driver.step()
        during.append(time.perf_counter() - began)
    driver.abort_all()
    base = statistics.median(before)
    print(f"{count} streams beside an image's encoding (SmolVLM-256M shapes, 1024x1024, {len(during)} steps): "
          f"time between tokens before {base * 1000:.1f} ms; during: median {statistics.median(during) / base:.2f}x, "
          f"90th percentile {np.percentile(during, 90) / base:.2f}x, longest {max(during) / base:.2f}x", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="encode-smolvlm,encode-gemma3,ttft,streams")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--quantization", default="auto", help="comma-separated: auto, int8, int4")
    args = parser.parse_args()
    wanted = args.only.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        parent = Path(tmp)
        for kind in ("smolvlm", "gemma3"):
            if f"encode-{kind}" in wanted:
                for quantization in args.quantization.split(","):
                    encode(kind, parent / f"encode-{kind}-{quantization}", args.rounds, quantization)
        if "ttft" in wanted:
            ttft(parent / "ttft", args.rounds)
        if "streams" in wanted:
            streams(parent / "streams", args.streams)
    return 0


if __name__ == "__main__":
    sys.exit(main())
