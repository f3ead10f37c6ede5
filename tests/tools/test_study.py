"""Smoke version of the convergence study (`lowbitcc study --quick`): a tiny GPT, 2 ranks.

At 4 bits with the default 128-element groups, plain quantization is nearly unbiased and this
tiny run cannot tell LoCo from no feedback (see docs/convergence.md). With 4096-element groups,
most small gradient entries round to zero in every step, the bias error feedback exists to
remove; there LoCo must stay closer to exact than 4-bit without feedback.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowbitcc.tools import study


@pytest.mark.slow  # trains; `pytest -m slow`
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


@pytest.mark.slow  # trains; `pytest -m slow`
def test_feedback_warm_up_trains_as_without_feedback_until_it_ends():
    # within its warm-up a LoCo variant's steps are the "-nofb" twin's, bit for bit: every
    # step's calls start without an error state; LoCo from the first step differs
    cfg = study.StudyConfig(steps=12, world=2, **study.QUICK)
    result = study.run(["nvfp4-nofb", "nvfp4-warm100", "nvfp4"], [0], cfg)
    rows = {r["variant"]: r for r in result["summary"]}
    assert rows["nvfp4-warm100"]["final_val_loss"] == rows["nvfp4-nofb"]["final_val_loss"]
    assert rows["nvfp4"]["final_val_loss"] != rows["nvfp4-nofb"]["final_val_loss"]


@pytest.mark.slow  # trains; `pytest -m slow`
def test_tracking_feedback_removes_the_bias_plain_quantization_keeps():
    # the default 128-element groups: on one gradient stream, the sum of LoCo's all-reduces
    # stays close to the sum of exact's while plain 4-bit quantization's drifts, and Adam's
    # update direction from LoCo's stream is the closer one
    from lowbitcc.tools.study import tracking

    cfg = study.StudyConfig(steps=40, world=2, **study.QUICK)
    result = tracking.run(["loco4", "loco4-nofb", "loco8"], cfg)
    rows = {r["variant"]: r for r in result["summary"]}
    loco, nofb, loco8 = rows["loco4"], rows["loco4-nofb"], rows["loco8"]
    assert len(result["series"]["loco4"]["sum_error"]) == 40
    assert loco["sum_error"] < 0.5 * nofb["sum_error"], (loco, nofb)
    assert loco["adam_error"] < nofb["adam_error"], (loco, nofb)
    # 8 bits: 1/18 of 4 bits' step (levels 127 and 7), every error far smaller
    assert loco8["step_error"] < 0.2 * loco["step_error"], (loco8, loco)
    assert 0 < loco["step_error"] < 0.5, loco


def test_across_seeds_pairs_each_variant_with_loco4_of_the_same_seed():
    summary = [
        {"variant": "exact", "seed": 0, "gap_to_exact": 0.0},
        {"variant": "loco4", "seed": 0, "gap_to_exact": 0.010},
        {"variant": "loco4-nofb", "seed": 0, "gap_to_exact": 0.015},
        {"variant": "exact", "seed": 1, "gap_to_exact": 0.0},
        {"variant": "loco4", "seed": 1, "gap_to_exact": 0.020},
        {"variant": "loco4-nofb", "seed": 1, "gap_to_exact": 0.016},
        {"variant": "loco8", "seed": 1, "gap_to_exact": 0.001},
    ]
    rows = {r["variant"]: r for r in study.across_seeds(summary)}
    assert set(rows) == {"loco4", "loco4-nofb", "loco8"}
    assert rows["loco4"]["mean_gap"] == pytest.approx(0.015)
    assert "vs_loco4" not in rows["loco4"]
    nofb = rows["loco4-nofb"]
    assert nofb["seeds"] == [0, 1]
    assert (nofb["min_gap"], nofb["max_gap"]) == (0.015, 0.016)
    assert nofb["vs_loco4_each"] == pytest.approx([0.005, -0.004])
    assert nofb["vs_loco4"] == pytest.approx(0.0005)
    assert rows["loco8"]["vs_loco4_each"] == pytest.approx([-0.019])
    assert "seed" in study.format_across_seeds(list(rows.values()))


def test_study_refuses_an_untrackable_variant_before_training():
    with pytest.raises(ValueError, match="cannot track.*fp16-hook"):
        study.run(["exact"], [0], study.StudyConfig(**study.QUICK), tracked=["fp16-hook"])


@pytest.mark.slow
def test_diloco_study_ranks_its_outer_syncs_and_times_them_at_the_link(tmp_path):
    """The DiLoCo study's smoke run: DDP and DiLoCo (fp32 and 4-bit LoCo outer sync, H 10) on
    2 sites, 2 seeds, timed behind an emulated wide-area link where root allows (a study:
    ``-m slow``, about 35 s; the outer sync itself is tests/backend/test_outer_sync.py's)."""
    from lowbitcc.tools import netem
    from lowbitcc.tools.link_spec import Link
    from lowbitcc.tools.study import diloco

    cfg = study.StudyConfig(steps=20, world=2, **study.QUICK)
    names = ["exact", "diloco-fp32-h10", "diloco-loco4-h10"]
    result = diloco.run([0, 1], cfg, Link("200mbit", "5ms"), out_dir=str(tmp_path),
                        variants=names)
    rows = {r["variant"]: r for r in result["diloco"]["variants"]}
    assert list(rows) == names and all(r["seeds"] == 2 for r in rows.values())
    # an outer sync every 10 steps: a tenth of DDP's fp32 bytes, and 4-bit LoCo under a sixth
    assert rows["diloco-fp32-h10"]["bytes_per_step"] == pytest.approx(
        rows["exact"]["bytes_per_step"] / 10)
    assert 0 < rows["diloco-loco4-h10"]["bytes_per_step"] < rows["diloco-fp32-h10"][
        "bytes_per_step"] / 6
    pairs = {(p["a"], p["b"]): p for p in result["diloco"]["pairs"]}
    loco_vs_fp32 = pairs[("diloco-loco4-h10", "diloco-fp32-h10")]
    assert loco_vs_fp32["seeds"] == [0, 1] and abs(loco_vs_fp32["mean"]) < 0.05
    timed = result["link_seconds_per_step"]
    if netem.missing_requirements():
        assert timed is None
    else:
        assert set(timed) == set(names) and all(t > 0 for t in timed.values())
        assert "link_s" in rows["exact"] and rows["exact"]["speedup"] == 1.0
    text = diloco.format_report(result["diloco"], result["link"], timed is not None)
    assert "diloco-loco4-h10 - diloco-fp32-h10" in text
    assert (tmp_path / "diloco.json").exists()


def test_outer_syncs_at_fewer_bits_are_paired_with_fp32_and_the_fewest_within_the_goal_named():
    from lowbitcc.tools.study import diloco
    from lowbitcc.tools.study.variants import DILOCO_VARIANTS, OUTER_BITS_VARIANTS, wire_bits

    assert not set(OUTER_BITS_VARIANTS) & set(DILOCO_VARIANTS)  # the default set stays as it is
    assert wire_bits("diloco-int2-h10") == wire_bits("diloco-loco2-h50") == 2.25
    assert wire_bits("diloco-nvfp4-loco-h10") == pytest.approx(4.53, abs=0.01)
    assert wire_bits("diloco-nvfp3-loco-h50") == wire_bits(
        "diloco-nvint3-h10") == pytest.approx(3.53, abs=0.01)
    assert wire_bits("diloco-loco4-h10") == 4.25 and wire_bits(
        "diloco-fp32-h50") == 32.0
    loss = {"diloco-fp32-h10": 2.0, "diloco-int2-h10": 2.02, "diloco-loco2-h10": 2.004,
            "diloco-nvfp4-h10": 2.001, "diloco-fp32-h50": 2.0, "diloco-int2-h50": 2.1}
    summary = [{"variant": v, "seed": s, "final_val_loss": x + 0.001 * s, "seconds": 1.0,
                "wire_bytes_per_step": 1.0} for v, x in loss.items() for s in (0, 1)]
    report = diloco.report({"summary": summary}, study.StudyConfig(steps=10))
    pairs = {(p["a"], p["b"]) for p in report["pairs"]}
    assert ("diloco-int2-h10", "diloco-fp32-h10") in pairs
    assert ("diloco-nvfp4-h10", "diloco-fp32-h10") in pairs
    best = report["fewest_bits"]
    assert best[10]["variant"] == "diloco-loco2-h10" and best[10]["bits"] == 2.25  # int2: +1%
    assert best[50] is None  # int2 at H 50 is 5% behind, nothing else ran there
    text = diloco.format_report(report, "none", False)
    assert "H 10: fewest bits within 0.3% of the fp32 outer sync: diloco-loco2-h10 (2.25" in text
    assert "H 50: fewest bits within 0.3% of the fp32 outer sync: none of those run" in text


def test_a_study_started_again_in_its_folder_resumes_where_it_stopped(tmp_path, monkeypatch):
    """`study.run` with ``out_dir`` keeps each finished run (``study.json`` and its parameters):
    started again after an interruption, it runs only what is missing, and its summary (the
    weight distances from the kept parameters included) is the uninterrupted study's; a study
    of another configuration in the folder is refused."""
    calls = []

    def fake_run_variant(variant, cfg, seed, threads=None):
        calls.append((variant.name, seed))
        if len(calls) == 3 and not (tmp_path / "stop").exists():
            (tmp_path / "stop").touch()
            raise KeyboardInterrupt  # interrupted during its third run
        params = torch.full((4,), 1.0 + seed + 0.1 * len(variant.name))
        return {"variant": variant.name, "seed": seed, "val_loss": [[0, 3.0], [cfg.steps, 2.0 + seed]],
                "train_loss": [1.0, 0.5], "seconds": 1.0, "wire_bytes_per_step": 100.0,
                "final_params": params}

    monkeypatch.setattr(study, "run_variant", fake_run_variant)
    cfg = study.StudyConfig(steps=5, world=2, **study.QUICK)
    names = ["exact", "loco4", "loco4-nofb"]
    with pytest.raises(KeyboardInterrupt):
        study.run(names, [0, 1], cfg, out_dir=str(tmp_path / "out"))
    calls.clear()
    resumed = study.run(names, [0, 1], cfg, out_dir=str(tmp_path / "out"))
    assert calls == [("loco4-nofb", 0), ("exact", 1), ("loco4", 1), ("loco4-nofb", 1)]
    calls.clear()
    whole = study.run(names, [0, 1], cfg, out_dir=str(tmp_path / "whole"))
    assert len(calls) == 6
    assert resumed["summary"] == whole["summary"]
    assert all("weight_distance" in row for row in resumed["summary"])
    calls.clear()
    study.run(names, [0, 1], cfg, out_dir=str(tmp_path / "out"))
    assert calls == []  # all done
    with pytest.raises(ValueError, match="another configuration"):
        study.run(names, [0, 1], dataclasses.replace(cfg, steps=6), out_dir=str(tmp_path / "out"))
