"""`lowbitcc hybrid`'s options and summary, on made-up results (the training itself:
tests/backend/test_device_mesh.py)."""

from __future__ import annotations

import math

import pytest

from lowbitcc.tools import hybrid


def _run(val: float, step_s: float = 0.5) -> dict:
    return {"losses": [5.0, val], "val_loss": val, "step_s": step_s,
            "bytes": {"link": 2e6, "lo": 1e6}, "compressed_calls": 3}


def test_summary_gives_each_schemes_gap_to_exact_of_the_same_seed():
    results = {0: {"exact": _run(2.0), "naive": _run(2.2, 1.0)},
               1: {"exact": _run(4.0), "naive": _run(4.0, 1.0)}}
    summary = hybrid.summarize(results)
    mean, sd, low, high = summary["naive"]["gap"]
    assert math.isclose(mean, 0.05) and math.isclose(low, 0.0) and math.isclose(high, 0.1)
    assert math.isclose(sd, math.sqrt(2) * 0.05)
    assert summary["exact"]["gap"][0] == 0 and summary["naive"]["step_ms"] == 1000.0
    assert summary["naive"]["bytes"] == {"link": 2.0, "lo": 1.0}
    report = hybrid.format_report(results, hybrid.HybridOptions(config="quick"), 4)
    assert "naive" in report and "+5.00%" in report and "0.50x" in report
    assert "link = the DP dimension" in report


@pytest.mark.parametrize("change,match", [
    ({"config": "huge"}, "unknown config"), ({"schemes": ("exact", "lossless")}, "lossless"),
    ({"seeds": ()}, "seed"), ({"warmup": 12}, "warmup"), ({"tp": 3}, "heads"),
])
def test_bad_options_are_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        hybrid.HybridOptions(**{"config": "quick", **change}).validate()


def test_every_scheme_names_configs_for_both_dimensions():
    assert set(hybrid.DEFAULT_SCHEMES) <= set(hybrid.SCHEMES)
    for dp, tp in hybrid.SCHEMES.values():
        for config in (dp, tp):
            assert config is None or (config.cost_model is False and config.policy != "never")
