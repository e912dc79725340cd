"""Which model folders /v1/systemone refuses: a trained decider's (its reading is not implemented)."""

from __future__ import annotations

from ember.server.native_routes import DECIDER_CONFIG, decider_config_of


def test_a_folder_with_a_decider_config_is_a_decider(tmp_path):
    assert decider_config_of(None) is None
    assert decider_config_of(str(tmp_path)) is None
    (tmp_path / DECIDER_CONFIG).write_text("{}")
    assert decider_config_of(str(tmp_path)) == tmp_path / DECIDER_CONFIG
    assert decider_config_of(str(tmp_path / DECIDER_CONFIG)) is None  # a file is not a model folder
