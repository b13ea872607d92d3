"""config.json parsing in both transformers dialects, and the reference config's numbers."""

from __future__ import annotations

import json

import pytest

from mci.errors import ConfigError
from mci.model_config import load_config, parse_config
from mci.tools.make_checkpoint import YARN_EXAMPLE, preset_config


def test_reference_config_derived_numbers(reference_config):
    cfg = reference_config
    assert cfg.kv_latent_dim == 576
    assert cfg.kv_bytes_per_token(2) == 70_272
    assert cfg.num_moe_layers == 58
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40
    assert cfg.fp8 is not None and cfg.fp8.block_size == (128, 128)
    assert cfg.num_mtp_layers == 1
    # softmax scale: 1/sqrt(192) * (0.1 * ln 40 + 1)^2
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 3.6888794541139363 + 1) ** 2)


def test_transformers5_dialect_defaults_routing_fields():
    cfg = preset_config("tiny", rope=YARN_EXAMPLE)
    raw5 = cfg.to_hf_dict("5")
    for absent in ("topk_method", "scoring_func", "moe_layer_freq", "rope_scaling", "rope_theta"):
        assert absent not in raw5
    assert parse_config(raw5) == parse_config(cfg.to_hf_dict("4")) == cfg


def test_moe_layer_freq_and_dense_prefix():
    cfg = preset_config("tiny", num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
            "unsupported architecture",
        ),
        ({"scoring_func": "softmax"}, "unsupported routing"),
        ({"vocab_size": "lots"}, "malformed field"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "unsupported rope type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "unsupported quantization"),
    ],
)
def test_bad_configs_raise_config_error(edit, message):
    raw = preset_config("tiny").to_hf_dict("4")
    raw.update(edit)
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_missing_field_and_bad_json(tmp_path):
    raw = preset_config("tiny").to_hf_dict("4")
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        parse_config(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)


def test_server_config_checks_itself_and_never_shows_its_api_key():
    from mci.errors import UserError
    from mci.server.config import ServerConfig

    assert "s3cret" not in repr(ServerConfig(api_key="s3cret"))
    for bad in ({"reasoning_parser": "nope"}, {"max_queue_time": -1}, {"dp_size": 0}):
        with pytest.raises(UserError, match="--"):
            ServerConfig(**bad)
