"""Which GGUF file of a repo a quantization tag names, as llama.cpp spells tags (`:Q4_K_M`), and
which of its mmproj files (a vision model's projector) goes with it.

Without a tag: the Q4_K_M file, else the smallest 4-bit file, else the smallest file. The mmproj:
one in the model file's folder whose precision is nearest the model's."""

from __future__ import annotations

import re

from ember.errors import ModelLoadError

DEFAULT_TAG = "Q4_K_M"
# A quantization name in a file name: Q4_K_M, Q8_0, IQ4_XS, F16, BF16, ... between separators.
_TAG = re.compile(r"(?:^|[-._])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=[-._]|$)", re.IGNORECASE)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def quant_tag(filename: str) -> str | None:
    """The quantization a GGUF file name carries (upper case), or None."""
    stem = filename.rsplit("/", 1)[-1]
    stem = _SPLIT.sub("", stem)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = _TAG.findall(stem)
    return found[-1].upper() if found else None


def gguf_files(sizes: dict[str, int]) -> dict[str, int]:
    """The loadable GGUF files among a repo's files (name -> size in bytes): no split parts or projectors."""
    return {name: size for name, size in sizes.items() if name.lower().endswith(".gguf") and not is_mmproj(name)}


def is_mmproj(name: str) -> bool:
    """Whether a file name (or repo path) is a vision model's projector, as llama.cpp names them."""
    base = name.rsplit("/", 1)[-1].lower()
    return base.startswith("mmproj") and base.endswith(".gguf")


def choose_mmproj(names: list[str], model: str) -> str | None:
    """The mmproj file among `names` (repo paths or file names) for the GGUF file `model`: one in the
    same folder, the nearest in bits to the model's quantization (F16 is 16 bits, Q8_0 8), the more
    precise of two as near, then by name; None when the folder has none."""
    folder = model.rsplit("/", 1)[0] if "/" in model else ""
    candidates = [name for name in names if is_mmproj(name)
                  and (name.rsplit("/", 1)[0] if "/" in name else "") == folder]
    if not candidates:
        return None
    bits = quant_bits(model)
    return min(candidates, key=lambda name: (abs(quant_bits(name) - bits), -quant_bits(name), name))


def quant_bits(filename: str) -> int:
    """The bits its quantization tag names (Q4_K_M: 4, F16: 16), 0 without one."""
    digits = re.search(r"\d+", quant_tag(filename) or "")
    return int(digits.group()) if digits else 0


def choose_gguf(sizes: dict[str, int], tag: str | None, where: str) -> str:
    """The file for `tag` among `sizes` (name -> bytes; GGUF files only). Raises ModelLoadError naming
    the tags there are when none matches."""
    by_tag: dict[str, list[str]] = {}
    for name in sorted(sizes):
        by_tag.setdefault(quant_tag(name) or "", []).append(name)
    if tag is None:
        if DEFAULT_TAG in by_tag:
            chosen = by_tag[DEFAULT_TAG]
        else:
            four_bit = [n for n in sizes if (quant_tag(n) or "").lstrip("I").startswith("Q4")]
            chosen = [min(four_bit or sizes, key=lambda n: (sizes[n], n))]
    else:
        chosen = by_tag.get(tag.upper(), [])
        if not chosen:
            raise ModelLoadError(f"{where} has no GGUF file for the tag {tag!r}; it has: {_describe(by_tag)}",
                                 param="model", code="model_not_found")
    if any(_SPLIT.search(name) for name in chosen):
        raise ModelLoadError(f"{where}: {chosen[0]} is split into parts, which ember cannot load; choose another "
                             f"tag ({_describe(by_tag)})", param="model", code="invalid_model")
    if len(chosen) > 1:
        raise ModelLoadError(f"{where} has several GGUF files for that tag ({', '.join(chosen)}); "
                             f"name one by its path", param="model", code="invalid_model")
    return chosen[0]


def _describe(by_tag: dict[str, list[str]]) -> str:
    if not by_tag:
        return "no GGUF files"
    return ", ".join(tag or names[0] for tag, names in sorted(by_tag.items()))
