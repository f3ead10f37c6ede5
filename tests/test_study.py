"""Smoke version of the convergence study (`lowbitcc study --quick`): a tiny GPT, 2 ranks.

At 4 bits with the default 128-element groups, plain quantization is nearly unbiased and this
tiny run cannot tell LoCo from no feedback (see docs/convergence.md). With 4096-element groups,
most small gradient entries round to zero in every step, the bias error feedback exists to
remove; there LoCo must stay closer to exact than 4-bit without feedback.
"""

from __future__ import annotations

import pytest

from lowbitcc import study


def test_loco_4bit_tracks_exact_closer_than_no_feedback(monkeypatch):
    monkeypatch.setenv("LOCO_GROUP_SIZE", "4096")
    cfg = study.StudyConfig(steps=80, world=2, **study.QUICK)
    result = study.run(["exact", "loco4", "loco4-nofb"], [0], cfg)
    rows = {r["variant"]: r for r in result["summary"]}
    exact, loco, nofb = rows["exact"], rows["loco4"], rows["loco4-nofb"]
    assert exact["final_val_loss"] < 3.0  # it learned something (uniform bytes: ln 256 = 5.5)
    assert loco["gap_to_exact"] < nofb["gap_to_exact"], (loco, nofb)
    assert loco["weight_distance"] < nofb["weight_distance"], (loco, nofb)
    assert loco["gap_to_exact"] < 0.03, loco
    # 4-bit codes plus one fp32 scale per 4096 elements: about 1/8 of fp32's bytes
    assert loco["bytes_vs_exact"] == pytest.approx(0.13, abs=0.02)
