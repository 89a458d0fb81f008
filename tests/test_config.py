"""Configs are validated at the boundary and a bad field is named in the error."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from raysd.config import PolicyConfig
from raysd.serve.config import ServerConfig

REPO = Path(__file__).resolve().parents[1]


def test_shipped_local_config_validates_and_resolves_model_dirs():
    config = ServerConfig.from_file(REPO / "deployments" / "local.yaml")
    assert config.host == "127.0.0.1" and config.port == 8000
    assert config.target.model_dir == REPO / "models" / "demo" / "target"
    assert config.draft.placement.actor_options()["resources"] == {"draft_device": 1}


def test_bad_config_fails_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  policy:\n    k_max: -3\n")
    with pytest.raises(ValidationError, match=r"router\.policy\.k_max"):
        ServerConfig.from_file(bad)
    bad.write_text("target:\n  tp_sise: 2\n")
    with pytest.raises(ValidationError, match=r"target\.tp_sise"):
        ServerConfig.from_file(bad)


def test_policy_hysteresis_bounds_are_checked():
    with pytest.raises(ValidationError, match="pressure_low"):
        PolicyConfig(pressure_high=10, pressure_low=20)
    with pytest.raises(ValidationError, match="pressure_reopen_s"):
        PolicyConfig(pressure_reopen_s=-0.5)
    assert PolicyConfig(pressure_reopen_s=0).pressure_reopen_s == 0  # 0: reopen at the first round below low
