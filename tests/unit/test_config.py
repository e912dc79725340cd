from ember.config import ModelConfig

BASE = dict(model_type="mistral", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)


def test_sliding_window_caps_the_context_to_the_window():
    assert ModelConfig.from_hf({**BASE, "sliding_window": 4096}).max_position_embeddings == 4096


def test_a_window_that_is_off_or_wider_than_the_context_changes_nothing():
    assert ModelConfig.from_hf({**BASE, "sliding_window": None}).max_position_embeddings == 32768
    assert ModelConfig.from_hf({**BASE, "sliding_window": 65536}).max_position_embeddings == 32768
    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen).max_position_embeddings == 32768


def test_transformers_5_rope_parameters_are_read():
    config = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert config.rope_theta == 5e5 and config.rope_scaling is None
