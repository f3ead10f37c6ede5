"""LocoConfig validation and environment parsing; the error-feedback store."""

from __future__ import annotations

import pytest
import torch

from lowbitcc import LocoConfig
from lowbitcc.feedback import FeedbackStore


def test_defaults_follow_the_design():
    c = LocoConfig()
    assert (c.bits, c.group_size, c.beta, c.error_dtype, c.reset_interval, c.min_size,
            c.policy) == (4, 128, 0.8, "int8", 1024, 65536, "backward")


@pytest.mark.parametrize("field,value,match", [
    ("bits", 3, "bits=3"), ("group_size", 100, "multiple of 8"), ("beta", 1.0, "beta"),
    ("beta", -0.1, "beta"), ("reset_interval", -1, "reset_interval"),
    ("error_dtype", "fp8", "error_dtype"), ("min_size", 0, "min_size"),
    ("policy", "sometimes", "policy"), ("max_keys", 0, "max_keys"), ("feedback", 1, "feedback"),
])
def test_invalid_values_raise_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        LocoConfig(**{field: value})


def test_environment_parsing():
    env = {"LOCO_BITS": "8", "LOCO_BETA": "0", "LOCO_FEEDBACK": "off", "LOCO_POLICY": "Always",
           "PATH": "/bin"}
    c = LocoConfig.from_env(env)
    assert (c.bits, c.beta, c.feedback, c.policy) == (8, 0.0, False, "always")
    with pytest.raises(ValueError, match="LOCO_BITS='four'"):
        LocoConfig.from_env({"LOCO_BITS": "four"})
    with pytest.raises(ValueError, match="unknown environment variable LOCO_BIT"):
        LocoConfig.from_env({"LOCO_BIT": "4"})


def test_store_reset_interval_shape_change_and_non_finite():
    store = FeedbackStore()
    e = torch.randn(2, 128)
    assert store.load("k", (2, 128), reset_interval=3) is None
    store.store("k", e, False, "fp32", 128)
    assert torch.equal(store.load("k", (2, 128), 3), e)
    store.store("k", e, False, "fp32", 128)
    store.store("k", e, False, "fp32", 128)
    assert store.uses("k") == 3
    assert store.load("k", (2, 128), 3) is None  # third use reached: reset
    store.store("k", e, False, "fp32", 128)
    assert store.load("k", (4, 128), 0) is None  # shape changed: reset
    store.store("k", e, False, "fp32", 128)
    store.store("k", e, True, "fp32", 128)
    assert "k" not in store.keys()


def test_int8_storage_is_accurate_and_lru_bounded():
    store = FeedbackStore(max_keys=2)
    e = torch.randn(3, 256)
    store.store("a", e, False, "int8", 128)
    back = store.load("a", (3, 256), 0)
    step = e.view(-1, 128).abs().amax(dim=1, keepdim=True) / 127
    assert bool(((back.view(-1, 128) - e.view(-1, 128)).abs() <= step / 2 + 1e-7).all())
    store.store("b", e, False, "bf16", 128)
    store.store("c", e, False, "int8", 128)
    assert store.keys() == ["b", "c"]


def test_state_dict_round_trip():
    store = FeedbackStore()
    store.store("a", torch.randn(1, 128), False, "int8", 128)
    store.store("b", torch.randn(1, 128), False, "fp32", 128)
    sd = store.state_dict()
    other = FeedbackStore()
    other.load_state_dict(sd)
    for key in ("a", "b"):
        assert torch.equal(other.load(key, (1, 128), 0), store.load(key, (1, 128), 0))
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"version": 99, "states": {}})
