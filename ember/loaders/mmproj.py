"""A vision model as llama.cpp ships it: the language model's GGUF and an mmproj GGUF beside it,
which holds the vision tower, the projector and the image preprocessing settings (clip.* metadata).
`attach_mmproj` joins the two into one ModelSource of the vision architecture:

- config: the language GGUF's config becomes text_config; the tower's vision_config, the
  projector's settings and the image token's id (from the language GGUF's vocabulary) join it;
- weights: the language GGUF's as before (its 4- and 8-bit blocks kept), then the mmproj's under
  transformers' checkpoint names, its quantized 2-D weights as blocks where the loader takes blocks
  (dequantized otherwise);
- image preprocessing: transformers' image processor settings (preprocessor_config.json's shape)
  from the metadata: image or tile size, mean and std, the longest edge; what llama.cpp fixes for
  the projector type rather than storing (Idefics3's Lanczos resampling and tiles plus the whole
  image, Gemma 3's bilinear resize to one square view) written out.

Projector types: idefics3 (Idefics3 and SmolVLM: llama.cpp writes both as this one type) and gemma3
(Gemma 3's SigLIP tower, average pooling, soft embedding norm and input projection).

Which file: the `mmproj` setting names one, or is "auto" (a file whose name starts with mmproj beside
the language GGUF, gguf_choice.choose_mmproj's choice of several) or "none". A language GGUF does not
say whether it was cut from a vision model, so without an mmproj it is served as the text model it
is. An mmproj found beside it that is not its pair (another projector, another width, a vocabulary
without the image tokens) is left aside with a warning; a named one that does not fit is refused.
The mmproj is read from its file at each load: its tensors need no conversion worth caching.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.errors import ModelLoadError
from ember.loaders.gguf_choice import choose_mmproj
from ember.loaders.gguf_file import MMPROJ_ARCHITECTURE, GGUFFile, shortest_float32
from ember.loaders.source import ModelSource, cut_each

if TYPE_CHECKING:
    import torch

    from ember.models.weights import QuantBlocks

logger = logging.getLogger("ember.loaders")

AUTO, NONE = "auto", "none"

# SigLIP's tower: llama.cpp's names (clip.cpp's TN_*) -> transformers' under the tower's prefix
_TOWER_NAMES = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
                "v.post_ln": "post_layernorm"}
_TOWER_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
                      "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
                      "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER_LAYER = re.compile(r"v\.blk\.(\d+)\.(\w+)")


@dataclass(frozen=True, slots=True)
class Projector:
    """What one clip.projector_type joins: which language model, under which architecture."""

    model_type: str  # the joined model's HF model_type
    architecture: str  # its HF class
    language_model_type: str  # the model_type of the language GGUF it joins
    tower_prefix: str  # the tower's checkpoint prefix
    tensors: dict[str, str]  # the projector's tensors: llama.cpp's name -> transformers' checkpoint name
    image_token: str
    layout_tokens: tuple[str, ...]  # the tokens its image layout writes: the vocabulary must hold them
    settings: Callable[["Mmproj", int], dict[str, Any]]  # (mmproj, image token id) -> the config's own fields
    preprocessor: Callable[["Mmproj"], dict[str, Any]]  # -> transformers' image processor settings
    # llama.cpp's name -> what its converter added to the tensor (Gemma's norms scale by 1 + w)
    norm_shifts: dict[str, float] = field(default_factory=dict)
    # llama.cpp's names of weights stored (in, out), a linear weight's transpose: read as floats, never blocks
    float_only: frozenset[str] = frozenset()


def _idefics3_settings(mmproj: "Mmproj", image_token_id: int) -> dict[str, Any]:
    return {"scale_factor": int(mmproj.metadata.get("clip.vision.projector.scale_factor", 2)),
            "image_token_id": image_token_id}


def _idefics3_preprocessor(mmproj: "Mmproj") -> dict[str, Any]:
    """Idefics3ImageProcessor's settings. An mmproj written before llama.cpp stored the longest edge
    takes transformers' default, 4 tiles (what Idefics3's and SmolVLM's own configs say)."""
    tile = int(mmproj.required("clip.vision.image_size"))
    longest_edge = mmproj.metadata.get("clip.vision.preproc_image_size")
    if longest_edge is None:
        logger.info("%s does not say the longest edge its images are resized to: %d (4 tiles) is taken",
                    mmproj.path.name, 4 * tile)
    return {"image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True, "resample": 1,  # Lanczos
            "size": {"longest_edge": int(longest_edge or 4 * tile)}, "max_image_size": {"longest_edge": tile},
            "image_mean": mmproj.floats("clip.vision.image_mean"), "image_std": mmproj.floats("clip.vision.image_std")}


_GEMMA3_POOLING = 4  # clip.cpp's default for gemma3 (every Gemma 3 release): patches per side pooled 4 to 1


def _gemma3_settings(mmproj: "Mmproj", image_token_id: int) -> dict[str, Any]:
    """Gemma3Config's fields: an image's tokens are the tower's square of patches average-pooled
    `clip.vision.projector.scale_factor` to 1 along each side (written only where it is not 4)."""
    side = int(mmproj.required("clip.vision.image_size")) // int(mmproj.required("clip.vision.patch_size"))
    pooling = int(mmproj.metadata.get("clip.vision.projector.scale_factor", _GEMMA3_POOLING))
    if pooling < 1 or side % pooling:
        raise ModelLoadError(f"{mmproj.path.name}: its scale factor {pooling} does not pool the tower's {side} x "
                             f"{side} patches evenly", param="mmproj", code="invalid_model")
    return {"mm_tokens_per_image": (side // pooling) ** 2, "image_token_index": image_token_id}


def _gemma3_preprocessor(mmproj: "Mmproj") -> dict[str, Any]:
    """Gemma3ImageProcessor's settings: one bilinear resize to the tower's square, no pan and scan
    (clip.cpp takes none)."""
    size = int(mmproj.required("clip.vision.image_size"))
    return {"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": False, "resample": 2,  # bilinear
            "size": {"height": size, "width": size},
            "image_mean": mmproj.floats("clip.vision.image_mean"), "image_std": mmproj.floats("clip.vision.image_std")}


PROJECTORS = {
    "idefics3": Projector(
        model_type="idefics3", architecture="Idefics3ForConditionalGeneration", language_model_type="llama",
        tower_prefix="model.vision_model.",
        tensors={"mm.model.fc.weight": "model.connector.modality_projection.proj.weight"},
        image_token="<image>", layout_tokens=("<image>", "<fake_token_around_image>", "<global-img>", "<row_1_col_1>"),
        settings=_idefics3_settings, preprocessor=_idefics3_preprocessor),
    # Gemma 3's original checkpoint names; its input projection is stored (vision, text), as llama.cpp keeps it
    "gemma3": Projector(
        model_type="gemma3", architecture="Gemma3ForConditionalGeneration", language_model_type="gemma3_text",
        tower_prefix="vision_tower.vision_model.",
        tensors={"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
                 "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
        image_token="<image_soft_token>", layout_tokens=("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
        settings=_gemma3_settings, preprocessor=_gemma3_preprocessor,
        norm_shifts={"mm.soft_emb_norm.weight": 1.0}, float_only=frozenset({"mm.input_projection.weight"})),
}


class Mmproj(GGUFFile):
    """An opened mmproj file of a projector type ember reads, its tensor names checked."""

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(path)
        if self.metadata.get("general.architecture") != MMPROJ_ARCHITECTURE:
            raise ModelLoadError(f"{path.name} is not an mmproj file (its architecture is "
                                 f"{self.metadata.get('general.architecture')!r}, not {MMPROJ_ARCHITECTURE!r})",
                                 param="mmproj", code="invalid_model")
        kind = self.metadata.get("clip.projector_type")
        if not self.metadata.get("clip.has_vision_encoder"):
            raise ModelLoadError(f"{path.name} holds no vision encoder", param="mmproj",
                                 code="unsupported_architecture")
        if kind not in PROJECTORS:
            raise ModelLoadError(f"{path.name}: its projector type is {kind!r}, and ember reads "
                                 f"{', '.join(PROJECTORS)}", param="mmproj", code="unsupported_architecture")
        if not self.metadata.get("clip.use_gelu"):
            raise ModelLoadError(f"{path.name}: its tower's activation is not GELU (clip.use_gelu), the only one "
                                 "ember's SigLIP tower runs", param="mmproj", code="unsupported_architecture")
        self.projector = PROJECTORS[kind]
        self.hidden_size = int(self.required("clip.vision.embedding_length"))
        self.num_layers = int(self.required("clip.vision.block_count"))
        self._names = {name: self._hf_name(name) for name in self.tensors}
        unknown = [name for name, hf_name in self._names.items() if hf_name is None]
        if unknown:
            raise ModelLoadError(f"{path.name} has tensors ember does not know for a {kind} projector: "
                                 f"{', '.join(unknown[:5])}", param="mmproj", code="invalid_model")

    def required(self, key: str) -> Any:
        if self.metadata.get(key) is None:
            raise ModelLoadError(f"{self.path.name} lacks the metadata key {key}", param="mmproj",
                                 code="invalid_model")
        return self.metadata[key]

    def floats(self, key: str) -> list[float]:
        return [shortest_float32(v) for v in self.required(key)]

    def vision_config(self) -> dict[str, Any]:
        """SigLIP's config.json fields (models.siglip.VisionConfig)."""
        return {"hidden_size": self.hidden_size,
                "intermediate_size": int(self.required("clip.vision.feed_forward_length")),
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": int(self.required("clip.vision.attention.head_count")),
                "image_size": int(self.required("clip.vision.image_size")),
                "patch_size": int(self.required("clip.vision.patch_size")),
                "layer_norm_eps": shortest_float32(self.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
                "hidden_act": "gelu_pytorch_tanh"}

    def _hf_name(self, name: str) -> str | None:
        if name in self.projector.tensors:
            return self.projector.tensors[name]
        base, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            return None
        if base in _TOWER_NAMES:
            return f"{self.projector.tower_prefix}{_TOWER_NAMES[base]}.{kind}"
        match = _TOWER_LAYER.fullmatch(base)
        if match is None or int(match.group(1)) >= self.num_layers or match.group(2) not in _TOWER_LAYER_NAMES:
            return None
        part = match.group(2)
        if part in ("ffn_up", "ffn_down") and self._ffn_swapped(int(match.group(1))):
            part = "ffn_down" if part == "ffn_up" else "ffn_up"
        return f"{self.projector.tower_prefix}encoder.layers.{match.group(1)}.{_TOWER_LAYER_NAMES[part]}.{kind}"

    def _ffn_swapped(self, layer: int) -> bool:
        """Files written by early converters hold the MLP's first layer as ffn_down (clip.cpp swaps
        them back when ffn_down takes the hidden width as its input)."""
        down = f"v.blk.{layer}.ffn_down.weight"
        if down not in self.tensors:
            return False
        rows, columns = self.torch_shape(down)
        return columns == self.hidden_size != rows

    # ---- weights ------------------------------------------------------------------------------

    def weights(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, "torch.Tensor"]]:
        """(transformers' name, float32 tensor) for every tensor not named in skip."""
        for name, hf_name in self._names.items():
            if hf_name not in skip:
                tensor = self.dequantize(name)
                shift = self.projector.norm_shifts.get(name)
                yield hf_name, tensor if shift is None else tensor - shift

    def blocks(self) -> Iterator[tuple[str, "QuantBlocks"]]:
        """(transformers' name, QuantBlocks) for every quantized 2-D weight the projector does not read as floats."""
        from ember.loaders.gguf_blocks import tensor_blocks

        for name, hf_name in self._names.items():
            blocks = None if name in self.projector.float_only else tensor_blocks(self, name)
            if blocks is not None:
                yield hf_name, blocks


# ---- joining a language model's source -----------------------------------------------------------

def attach_mmproj(source: ModelSource, model_path: pathlib.Path, setting: str) -> ModelSource:
    """The language GGUF's source joined to its mmproj (see the module's docstring); `model_path`:
    the GGUF as named (beside which "auto" looks), `setting`: auto, none, or an mmproj's path."""
    if setting == NONE:
        return source
    if setting != AUTO:
        return _join(source, _named_file(pathlib.Path(setting).expanduser()))
    found = find_mmproj(model_path)
    if found is None:
        logger.info("%s: no mmproj file beside it, so it is served as a text model", model_path.name)
        return source
    try:
        return _join(source, found)
    except ModelLoadError as exc:
        logger.warning("%s is left aside, so %s is served as a text model: %s", found.name, model_path.name,
                       exc.message)
        return source


def find_mmproj(model_path: pathlib.Path) -> pathlib.Path | None:
    """The mmproj file beside a GGUF file (gguf_choice.choose_mmproj), if any."""
    try:
        names = sorted(p.name for p in model_path.parent.iterdir() if p.is_file())
    except OSError:
        return None
    chosen = choose_mmproj(names, model_path.name)
    return None if chosen is None else model_path.parent / chosen


def _named_file(path: pathlib.Path) -> pathlib.Path:
    if not path.is_file():
        raise ModelLoadError(f"the mmproj file {str(path)!r} does not exist", param="mmproj",
                             code="model_not_found")
    return path


def _join(source: ModelSource, path: pathlib.Path) -> ModelSource:
    try:
        mmproj = Mmproj(path)
    except ModelLoadError as exc:
        raise ModelLoadError(exc.message, param="mmproj", code=exc.code) from None
    projector = mmproj.projector
    text = source.hf_config
    where = f"{path.name} ({mmproj.metadata['clip.projector_type']})"
    if text["model_type"] != projector.language_model_type:
        raise ModelLoadError(f"{where} goes with a {projector.language_model_type} language model, and "
                             f"{source.name} is {text['model_type']}", param="mmproj", code="invalid_model")
    width = int(mmproj.required("clip.vision.projection_dim"))
    if width != text["hidden_size"]:
        raise ModelLoadError(f"{where} projects to a width of {width}, and {source.name}'s is "
                             f"{text['hidden_size']}: they are not a pair", param="mmproj", code="invalid_model")
    vocabulary = source.tokenizer.hf.get_vocab()
    missing = [token for token in projector.layout_tokens if token not in vocabulary]
    if missing:
        raise ModelLoadError(f"{source.name}'s vocabulary lacks {', '.join(missing)}, which {where} needs",
                             param="mmproj", code="invalid_model")
    hf_config = {"architectures": [projector.architecture], "model_type": projector.model_type,
                 "text_config": text, "vision_config": mmproj.vision_config(),
                 "tie_word_embeddings": text["tie_word_embeddings"], "eos_token_id": text["eos_token_id"],
                 **projector.settings(mmproj, vocabulary[projector.image_token])}
    language_weights, language_blocks = source.read_weights, source.read_blocks

    def read_weights(skip: frozenset[str] = frozenset(), cut=None) -> Iterator[tuple[str, Any]]:
        yield from language_weights(skip, cut)
        yield from cut_each(mmproj.weights(skip), cut)

    def read_blocks() -> Iterator[tuple[str, Any]]:
        if language_blocks is not None:
            yield from language_blocks()
        yield from mmproj.blocks()

    logger.info("%s: its vision part is %s, so it reads images", source.name, path.name)
    return dataclasses.replace(source, hf_config=hf_config, read_weights=read_weights, read_blocks=read_blocks,
                               preprocessor_config=projector.preprocessor(mmproj), mmproj_path=str(path))
