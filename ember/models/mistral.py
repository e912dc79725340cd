"""Mistral: the Llama decoder; its sliding window (sliding_window in the config, every layer local)
is the attention backends' business, read from ModelConfig.layer_windows."""

from __future__ import annotations

from ember.models import llama


class Model(llama.Model):
    pass
