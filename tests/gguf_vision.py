"""A tiny SmolVLM or Gemma 3 folder turned into llama.cpp's pair of GGUF files (the language model, and
the mmproj with the vision tower, the projector and the preprocessing settings) by llama.cpp's own
converter.

The converter is llama.cpp's source (convert_hf_to_gguf.py, conversion/, gguf-py/), as the
llama-cpp-python source package ships it under vendor/llama.cpp; the environment variable
EMBER_LLAMA_CPP names that folder (.ci/run fetches the package and sets it), and the tests that
need it are skipped without it. Its three parts are copied into a temporary folder and run there
in a subprocess, with its own gguf-py on the path.

The folder is made convertible as real SmolVLM folders are: its text_config names its
architecture (VLlama3ForCausalLM, which the converter reads for the language GGUF), and its weights
are rounded to float16 values, so that a float16 conversion holds them exactly. A Gemma 3 folder is
made convertible as Google's release is (write_convertible_gemma3), its weights rounded too.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from vision_fixtures import GEMMA3_TOKENS_PER_IMAGE, add_random_weights, write_gemma3_folder, write_smolvlm_folder

LLAMA_CPP_ENV = "EMBER_LLAMA_CPP"
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
# llama.cpp takes every sixth Gemma 3 layer as global rather than reading the config's layer types
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def llama_cpp_source() -> pathlib.Path:
    """llama.cpp's source folder (EMBER_LLAMA_CPP); skips the calling test when it is not there."""
    folder = os.environ.get(LLAMA_CPP_ENV)
    if not folder or not (pathlib.Path(folder) / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"{LLAMA_CPP_ENV} does not name llama.cpp's source (the llama-cpp-python source package's "
                    "vendor/llama.cpp), whose converter these tests run")
    return pathlib.Path(folder)


def copy_converter(source: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """The converter's parts copied into `into`; returns its script there."""
    into.mkdir(parents=True, exist_ok=True)
    for part in _CONVERTER_PARTS:
        if (source / part).is_dir():
            shutil.copytree(source / part, into / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source / part, into / part)
    return into / "convert_hf_to_gguf.py"


def write_convertible_smolvlm(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The tiny SmolVLM folder (vision_fixtures) with random weights, as the converter takes it."""
    add_random_weights(write_smolvlm_folder(folder), seed)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    config_file.write_text(json.dumps(config, indent=2))
    return round_to_float16(folder)


def write_convertible_gemma3(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The tiny Gemma 3 folder (vision_fixtures) as the converter takes it, shaped as Google's release:
    six decoder layers, the sixth global (GEMMA3_LAYER_TYPES); the tower's weights under
    vision_tower.vision_model. (the names the converter maps); processor_config.json's
    image_seq_length (from which the converter writes the projector's pooling)."""
    write_gemma3_folder(folder, seed=seed, text_config={"num_hidden_layers": 6, "layer_types": GEMMA3_LAYER_TYPES})
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_length": GEMMA3_TOKENS_PER_IMAGE,
                                                              "processor_class": "Gemma3Processor"}))
    return round_to_float16(folder, lambda name: name.replace("vision_tower.", "vision_tower.vision_model.", 1))


def round_to_float16(folder: pathlib.Path, rename=lambda name: name) -> pathlib.Path:
    """The folder's weights rounded to float16 values (in their own dtype), each saved as rename(name)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = folder / "model.safetensors"
    weights = {rename(name): tensor.to(torch.float16).to(tensor.dtype) for name, tensor in load_file(weights_file).items()}
    save_file(weights, weights_file, metadata={"format": "pt"})
    return folder


def convert_pair(script: pathlib.Path, folder: pathlib.Path, into: pathlib.Path, outtype: str
                 ) -> tuple[pathlib.Path, pathlib.Path]:
    """The folder's language GGUF and its mmproj in `into`, named as llama.cpp's repos name them
    (NAME-F16.gguf, mmproj-NAME-F16.gguf)."""
    tag = outtype.upper()
    into.mkdir(parents=True, exist_ok=True)
    return (convert(script, folder, into / f"{folder.name}-{tag}.gguf", outtype),
            convert(script, folder, into / f"mmproj-{folder.name}-{tag}.gguf", outtype, mmproj=True))


def convert(script: pathlib.Path, folder: pathlib.Path, out: pathlib.Path, outtype: str,
            mmproj: bool = False) -> pathlib.Path:
    """Run the converter on `folder` into `out` (outtype f32, f16, bf16 or q8_0)."""
    command = [sys.executable, str(script), str(folder), "--outtype", outtype, "--outfile", str(out)]
    env = {key: value for key, value in os.environ.items() if key != "NO_LOCAL_GGUF"}
    done = subprocess.run(command + (["--mmproj"] if mmproj else []), capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and out.is_file(), done.stderr[-4000:]
    return out
