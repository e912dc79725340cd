"""ember's perplexity against llama.cpp's `llama-perplexity` on the same GGUF file and text,
counted the way llama-perplexity counts it, in one run.

    python bench/perplexity_vs_llama_cpp.py --llama-perplexity PATH/TO/llama-perplexity
        [--model FILE.gguf] [--text FILE] [--ctx 512] [--chunks 8] [--threads 2]

llama-perplexity cuts the text's tokens (BOS first, where the model adds one) into chunks of
--ctx, puts BOS in each chunk's first place, and scores the second half of each chunk: the
log-probability of every token from ctx/2 + 1 on, given the chunk before it. ember scores the same
chunks of its own tokens the same way, in one forward pass a chunk (dense causal attention, the
model's own layers and kernels), once in the file's own blocks (the default load, bfloat16) and
once with every weight dequantized to float32 (the file's weights without ember's activation
rounding). Both tokenizers read the file's vocabulary.

The text: ember's own docs (docs/*.md in name order, as plain text) unless --text names a file.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from quality import LONG_TEXT, log_probs

from ember import LLM
from ember.loaders.default_model import default_model_path


def ember_perplexity(llm: LLM, tokens: list[int], ctx: int, chunks: int) -> float:
    bos = llm.tokenizer.bos_token_id if tokens and tokens[0] == llm.tokenizer.bos_token_id else None
    first, nll, count = ctx // 2, 0.0, 0
    for i in range(chunks):
        chunk = tokens[i * ctx:(i + 1) * ctx]
        if bos is not None:
            chunk = [bos] + chunk[1:]
        log_p = log_probs(llm, chunk)
        targets = torch.tensor(chunk[first + 1:])
        nll -= log_p[first:-1].double().gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def llama_cpp_perplexity(binary: str, model: str, text: Path, ctx: int, chunks: int, threads: int) -> float:
    result = subprocess.run([binary, "-m", model, "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks",
                             str(chunks), "-t", str(threads)], capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise SystemExit(f"llama-perplexity printed no estimate:\n{result.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-perplexity", required=True, help="llama.cpp's llama-perplexity binary")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--text", type=Path, default=None, help="a text file (default: ember's docs)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    with tempfile.TemporaryDirectory() as folder:
        text = args.text
        if text is None:
            text = Path(folder) / "docs.txt"
            text.write_text("\n\n".join(path.read_text() for path in LONG_TEXT))
        theirs = llama_cpp_perplexity(args.llama_perplexity, model, text, args.ctx, args.chunks, args.threads)
        rows = []
        for label, settings in (("ember, the file's own blocks (the default)", {}),
                                ("ember, dequantized to float32", dict(dtype="float32", quantization="none"))):
            llm = LLM(model, max_model_len=max(args.ctx, 1024), **settings)
            tokens = llm.tokenizer.encode(text.read_text(), add_special_tokens=True)
            if len(tokens) < args.ctx * args.chunks:
                raise SystemExit(f"the text has {len(tokens)} tokens, fewer than {args.chunks} chunks of {args.ctx}")
            rows.append((label, ember_perplexity(llm, tokens, args.ctx, args.chunks)))
            del llm
    print(f"{Path(model).name}: {args.chunks} chunks of {args.ctx} tokens, the second half of each scored")
    print("| | perplexity | / llama-perplexity |")
    print("| --- | --- | --- |")
    print(f"| llama-perplexity | {theirs:.4f} | 1 |")
    for label, ppl in rows:
        print(f"| {label} | {ppl:.4f} | {ppl / theirs:.4f} |")


if __name__ == "__main__":
    main()
