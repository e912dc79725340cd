"""A Llama-shaped decoder's layers in one call of ember's CPU kernels (`decoder_layers`, in
ember/kernels/decoder.cpp) in place of a Python loop of ten ops a layer; Gemma 3's
(`gemma_decoder_layers`, GemmaLayerStack) in place of its loop of about twenty.

The call runs the ops the loop runs, in its order, on the same tensors, so its bits are the loop's.
It serves only where every layer is the plain Llama layer on the kernels: norms, rotary and SiLU
fused, the four projections block-quantized without biases, no forward hooks, no layer split over
tensor-parallel ranks (their sums cross ranks between the ops), and attention over the kernels'
cache layout (an `attn` with `layer_arguments`). Anything else, and any step it does not serve,
runs the loop.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ember.models.weights import BlockWeights, StackedBlockWeights


def decided_stack(decoder: nn.Module, stack_class: type, *classes: type) -> Any:
    """The decoder's layers as one call of `stack_class` where they fit it (`fits(layers, *classes)`),
    else None: decided at the first step with fused ops (use_fused_ops comes after the formats and
    any hooks) and kept in `decoder._stack` (None: not decided yet; False: the loop)."""
    if not decoder.fused:
        return None
    if decoder._stack is None:
        layers = list(decoder.layers)
        decoder._stack = stack_class(layers) if stack_class.fits(layers, *classes) else False
    return decoder._stack or None


def _plain_layers(layers: Sequence[nn.Module]) -> bool:
    """No module with hooks (a hook must see its module run) and none with a tensor-parallel group
    (its sums cross ranks between the ops)."""
    return not any(module._forward_hooks or module._forward_pre_hooks or getattr(module, "parallel", None) is not None
                   for layer in layers for module in layer.modules())


class _Projections:
    """The layers' projections as the one call takes them: (packed blocks, formats, output widths,
    parts a projection) where every weight is in blocks (a stacked layer's parts one by one),
    without a bias, in the step's dtype; else None. Built once and kept while each linear holds
    the same weights object with the same packed tensors (a format change replaces the object, a
    move onto huge pages the tensor): a step then pays a few list reads instead of the lists and a
    check of every weight."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        self.linears = linears
        self._held: tuple[torch.dtype, list[Any], list[Any]] | None = None  # what the arguments came from
        self._held_parts: list[tuple[BlockWeights, torch.Tensor]] = []  # stacked layers' parts and their tensors
        self._arguments: tuple[list[torch.Tensor], list[int], list[int], list[int]] | None = None

    def arguments(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int], list[int], list[int]] | None:
        weights = [linear.weights for linear in self.linears]
        packed = [getattr(w, "packed", None) for w in weights]  # a stacked layer's parts are checked apart
        held = self._held
        if held is None or held[0] != dtype or not all(map(operator.is_, weights, held[1])) \
                or not all(map(operator.is_, packed, held[2])) \
                or not all(part.packed is tensor for part, tensor in self._held_parts):
            parts = [w.parts if type(w) is StackedBlockWeights else [w] for w in weights]
            every = [part for each in parts for part in each]
            fit = all(w.bias is None and w.dtype == dtype for w in weights) and all(
                type(part) is BlockWeights for part in every)
            self._arguments = ([part.packed for part in every], [part.format for part in every],
                               [part.out_features for part in every], [len(each) for each in parts]) if fit else None
            self._held = (dtype, weights, packed)
            self._held_parts = [(part, part.packed) for w in weights if type(w) is StackedBlockWeights
                                for part in w.parts]
        return self._arguments


class LayerStack:
    """The modules the one call reads, found once; their weights are looked at every call
    (_Projections), as a format may change (prepare_linears) or move (huge pages) after the stack
    is built."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.norms = [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.projections = _Projections([linear for layer in layers for linear in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)])
        self.eps = self.norms[0].eps
        self.heads, self.kv_heads = layers[0].self_attn.num_heads, layers[0].self_attn.num_kv_heads

    @staticmethod
    def fits(layers: Sequence[nn.Module], layer_class: type, attention_class: type, mlp_class: type) -> bool:
        """Every layer exactly of these classes (a subclass may compute otherwise), fused, one norm
        epsilon, one head count, no module with hooks and none with a tensor-parallel group."""
        if not layers:
            return False
        first = layers[0]
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            if not (type(layer) is layer_class and type(attention) is attention_class and type(mlp) is mlp_class
                    and attention.fused and not attention.qk_norm and mlp.fused
                    and layer.input_layernorm.fused and layer.post_attention_layernorm.fused
                    and layer.input_layernorm.eps == layer.post_attention_layernorm.eps == first.input_layernorm.eps
                    and (attention.num_heads, attention.num_kv_heads)
                    == (first.self_attn.num_heads, first.self_attn.num_kv_heads)):
                return False
        return _plain_layers(layers)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attn: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's output, residual stream before it), or None where the call does not serve."""
        arguments = getattr(attn, "layer_arguments", None)
        projections = self.projections.arguments(x.dtype)
        if arguments is None or projections is None:
            return None
        k_caches, v_caches, windows, slots, block_table, row_begin, first_pos, scale = arguments()
        return torch.ops.ember.decoder_layers(
            x, *projections, [norm.weight for norm in self.norms], self.eps, cos, sin, k_caches, v_caches, slots,
            block_table, row_begin, first_pos, scale, windows, self.heads, self.kv_heads)


class GemmaLayerStack:
    """Gemma 3's text layers (models.gemma3_text) as one call, on the terms of LayerStack: every
    layer exactly of the given classes with fused ops, one norm epsilon, the four projections in
    blocks without biases, no hooks, the kernels' cache layout."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.norms = [norm for layer in layers for norm in (
            layer.input_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm, layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)]
        self.projections = _Projections([linear for layer in layers for linear in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)])
        attention = layers[0].self_attn
        self.eps, self.q_scale = self.norms[0].eps, attention.q_scale
        self.heads, self.kv_heads = _heads(attention)

    @staticmethod
    def fits(layers: Sequence[nn.Module], layer_class: type, attention_class: type, mlp_class: type) -> bool:
        if not layers:
            return False
        first = layers[0]
        for layer in layers:
            attention = layer.self_attn
            norms = (layer.input_layernorm, attention.q_norm, attention.k_norm, layer.post_attention_layernorm,
                     layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
            if not (type(layer) is layer_class and type(attention) is attention_class and type(layer.mlp) is mlp_class
                    and attention.fused and all(n.fused and n.eps == first.input_layernorm.eps for n in norms)
                    and attention.q_scale == first.self_attn.q_scale and _heads(attention) == _heads(first.self_attn)):
                return False
        return _plain_layers(layers)

    def run(self, x: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]], attn: Any) -> torch.Tensor | None:
        """The residual stream after the last layer, or None where the call does not serve.
        tables: each layer's (cos, sin)."""
        arguments = getattr(attn, "layer_arguments", None)
        projections = self.projections.arguments(x.dtype)
        if arguments is None or projections is None:
            return None
        k_caches, v_caches, windows, slots, block_table, row_begin, first_pos, scale = arguments()
        return torch.ops.ember.gemma_decoder_layers(
            x, *projections, [norm.scale() for norm in self.norms], self.eps, [cos for cos, _ in tables], [sin for _, sin in tables],
            self.q_scale, k_caches, v_caches, slots, block_table, row_begin, first_pos, scale, windows, self.heads,
            self.kv_heads)


def _heads(attention: nn.Module) -> tuple[int, int]:
    """(query heads, key-value heads) of an attention's fused qkv projection."""
    sizes, head_dim = attention.qkv_proj.out_sizes, attention.qkv_proj.head_dim
    return sizes[0] // head_dim, sizes[1] // head_dim
