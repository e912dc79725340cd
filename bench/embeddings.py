"""Embedding throughput: ember's engine against sentence-transformers on the same model, in one run.

    python bench/embeddings.py [--passages 1000] [--tokens 128] [--dtype float32|bfloat16]
        [--ember-dtype float32|bfloat16] [--quantization none|int8] [--model FOLDER]

`--dtype` is sentence-transformers' (its default is float32); ember runs `--ember-dtype` (default:
the same) with `--quantization` (default none), so that both the like-for-like figure and ember's
served default (`ember serve --embeddings` on a folder: bfloat16) can be taken.

Without --model, a random model of Qwen3-Embedding-0.6B's shape (28 layers, hidden 1024, 16 query
and 8 KV heads, last-token pooling, normalised) is built locally and saved with
sentence-transformers' files. Each passage is `--tokens` random token ids. Both sides embed every
passage once after a short warm-up; the table gives passages per second and the mean cosine
between the two sides' vectors.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import tempfile
import time

import torch

QWEN3_EMBEDDING_0_6B = dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def build_model(folder: pathlib.Path) -> pathlib.Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_EMBEDDING_0_6B)).eval()
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(QWEN3_EMBEDDING_0_6B["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t1", pad_token="t1").save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 1024, "pooling_mode": "lasttoken", "include_prompt": True}))
    (folder / "2_Normalize").mkdir()
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--ember-dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8"])
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size")
    parser.add_argument("--model", default=None, help="a sentence-transformers folder (default: a random model)")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from ember.llm import LLM
    from ember.types import SamplingParams

    with tempfile.TemporaryDirectory() as scratch:
        folder = pathlib.Path(args.model) if args.model else build_model(pathlib.Path(scratch) / "qwen3-embedding")
        rng = random.Random(0)
        words = [" ".join(f"t{rng.randrange(2, 30000)}" for _ in range(args.tokens - 1)) for _ in range(args.passages)]
        st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"torch_dtype": getattr(torch, args.dtype)})
        st.encode(words[:4], batch_size=args.batch_size)
        began = time.perf_counter()
        theirs = st.encode(words, batch_size=args.batch_size, convert_to_tensor=True).float()
        st_seconds = time.perf_counter() - began
        del st

        ember_dtype = args.ember_dtype or args.dtype
        llm = LLM(str(folder), dtype=ember_dtype, quantization=args.quantization, max_model_len=max(256, 2 * args.tokens),
                  max_num_batched_tokens=8192, max_num_seqs=256)
        prompts = [llm.tokenizer.encode(text, add_special_tokens=True) for text in words]
        params = SamplingParams(max_tokens=0, pooling="last")
        llm.generate(prompts[:4], params)
        began = time.perf_counter()
        ours = torch.tensor([output.pooled for output in llm.generate(prompts, params)])
        ember_seconds = time.perf_counter() - began

    cosines = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    print(f"{args.passages} passages of {args.tokens} tokens; sentence-transformers {args.dtype}, "
          f"ember {ember_dtype} (quantization {args.quantization})")
    print(f"{'':24}{'passages/s':>12}")
    print(f"{'sentence-transformers':24}{args.passages / st_seconds:12.1f}")
    print(f"{'ember':24}{args.passages / ember_seconds:12.1f}")
    print(f"ember / sentence-transformers: {st_seconds / ember_seconds:.2f}x; mean cosine {cosines.mean():.6f}, "
          f"lowest {cosines.min():.6f}")


if __name__ == "__main__":
    main()
