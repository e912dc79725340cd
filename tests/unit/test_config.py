import pytest

from ember.config import EngineConfig, ModelConfig
from ember.errors import ModelLoadError

BASE = dict(model_type="mistral", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)


def test_a_sliding_window_keeps_the_whole_context_and_windows_every_layer():
    config = ModelConfig.from_hf({**BASE, "sliding_window": 4096})
    assert config.max_position_embeddings == 32768
    assert config.layer_windows == [4096, 4096]


def test_a_window_that_is_off_or_wider_than_the_context_changes_nothing():
    for hf in ({**BASE, "sliding_window": None}, {**BASE, "sliding_window": 65536},
               {**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}):
        config = ModelConfig.from_hf(hf)
        assert config.max_position_embeddings == 32768 and config.layer_windows == []


@pytest.mark.parametrize("extra, windows", [
    ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, [512, None, 512]),
    ({"sliding_window_pattern": 3}, [512, 512, None]),  # Gemma 3's first configs: every third global
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}, [None, 512, 512]),
])
def test_per_layer_windows_come_from_the_config(extra, windows):
    config = ModelConfig.from_hf({**BASE, "num_hidden_layers": 3, "sliding_window": 512, **extra})
    assert config.layer_windows == windows


def test_layer_types_of_the_wrong_length_are_a_load_error():
    with pytest.raises(ModelLoadError, match="layer_types"):
        ModelConfig.from_hf({**BASE, "sliding_window": 512, "layer_types": ["sliding_attention"]})


def test_transformers_5_rope_parameters_are_read():
    config = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert config.rope_theta == 5e5 and config.rope_scaling is None


def test_a_rope_scaling_override_makes_the_stretched_length_the_trained_length():
    config = ModelConfig.from_hf({**BASE, "max_position_embeddings": 8192})
    yarn = config.with_rope_scaling({"type": "yarn", "factor": 4})
    assert yarn.max_position_embeddings == 32768
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    linear = config.with_rope_scaling({"rope_type": "linear", "factor": 2.5, "original_max_position_embeddings": 4096})
    assert linear.max_position_embeddings == 10240 and linear.rope_scaling["rope_type"] == "linear"
    assert config.max_position_embeddings == 8192 and config.rope_scaling is None


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "dynamic", "factor": 2}, "linear or yarn"), ({"rope_type": "yarn"}, "factor above 1"),
    ({"rope_type": "yarn", "factor": 1}, "factor above 1"), ({"rope_type": "yarn", "factor": True}, "factor above 1"),
    ({"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 0}, "positive integer"),
    (["yarn"], "JSON object")])
def test_a_rope_scaling_override_is_checked_up_front(scaling, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(rope_scaling=scaling)
