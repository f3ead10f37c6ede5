"""The long form's report (`lowbitcc.tools.study.long_report`): the gap to exact at every
evaluation step, its mean over seeds, and where two variants' curves cross."""

from __future__ import annotations

import math

import pytest

from lowbitcc.tools.study import long_report


def _run(variant: str, seed: int, losses: list[float], configuration: str = "gpt",
         world: int = 2) -> dict:
    return {"configuration": configuration, "world": world, "seed": seed, "variant": variant,
            "val_loss": [[100 * i, loss] for i, loss in enumerate(losses)]}


RUNS = [
    _run("exact", 0, [4.0, 2.0, 1.0, 0.5]),
    _run("exact", 1, [4.0, 2.0, 1.0, 0.5]),
    # without feedback: ahead early, behind late (the drift the long form is for)
    _run("nvfp4-nofb", 0, [4.0, 1.98, 1.01, 0.51]),
    _run("nvfp4-nofb", 1, [4.0, 1.99, 1.02, 0.52]),
    # with feedback: behind early, level at the end; seed 1 stopped after two evaluations
    _run("nvfp4", 0, [4.0, 2.02, 1.005, 0.5]),
    _run("nvfp4", 1, [4.0, 2.01]),
    _run("mxfp4", 2, [4.0, 2.5]),  # no exact of its seed: left out
]


def test_gaps_are_paired_with_exact_of_the_same_seed_and_step_and_averaged():
    curves = long_report.gap_curves(RUNS)
    assert set(curves) == {("gpt", 2)} and set(curves["gpt", 2]) == {"nvfp4-nofb", "nvfp4"}
    nofb = {step: (gap, se, n) for step, gap, se, n in curves["gpt", 2]["nvfp4-nofb"]}
    assert nofb[0] == (0.0, 0.0, 2)
    assert nofb[100][0] == pytest.approx(-0.0075) and nofb[100][2] == 2
    assert nofb[300][0] == pytest.approx(0.03)
    assert nofb[300][1] == pytest.approx(0.01)  # the stdev of 0.02 and 0.04 over sqrt(2)
    fb = {step: (gap, se, n) for step, gap, se, n in curves["gpt", 2]["nvfp4"]}
    assert fb[100][0] == pytest.approx(0.0075) and fb[100][2] == 2
    assert fb[200][2] == 1 and math.isnan(fb[200][1])  # one seed: no standard error
    assert fb[300][0] == pytest.approx(0.0)


def test_crossings_are_the_steps_where_the_order_flips():
    curves = long_report.gap_curves(RUNS)["gpt", 2]
    assert long_report.crossings(curves["nvfp4"], curves["nvfp4-nofb"]) == [200]
    assert long_report.crossings(curves["nvfp4-nofb"], curves["nvfp4-nofb"]) == []
    a = [(0, 0.0, 0.0, 1), (1, 1.0, 0.0, 1), (2, -1.0, 0.0, 1), (3, 1.0, 0.0, 1)]
    b = [(0, 0.0, 0.0, 1), (1, 0.0, 0.0, 1), (2, 0.0, 0.0, 1), (3, 0.0, 0.0, 1)]
    assert long_report.crossings(a, b) == [2, 3]


def test_the_markdown_table_shows_the_default_first_and_the_crossing():
    text = long_report.format_markdown(RUNS, every=200)
    lines = text.splitlines()
    assert lines[0].startswith("**gpt, 2 ranks**")
    assert lines[2] == "| step | nvfp4-nofb | nvfp4 |"
    assert "| 200 | +1.50% (2) | +0.50% (1) |" in lines
    assert "| 300 | +3.00% (2) | +0.00% (1) |" in lines  # the last step, whatever ``every``
    assert not any(line.startswith("| 100 ") or line.startswith("| 0 ") for line in lines)
    assert "nvfp4 against nvfp4-nofb: the curves cross at steps 200" in text
    # the default first, whatever other variant without feedback sorts before it
    more = [*RUNS, _run("int8-nofb", 0, [4.0, 2.0, 1.0, 0.5])]
    assert "| step | nvfp4-nofb | int8-nofb | nvfp4 |" in long_report.format_markdown(more)


def test_the_default_variant_trains_as_the_librarys_defaults():
    from lowbitcc.codec import formats
    from lowbitcc.tools.study.variants import THE_DEFAULT, VARIANTS

    env = dict(VARIANTS[THE_DEFAULT].env)
    assert env["LOCO_FORMAT"] == formats.auto(4, "nearest") and env["LOCO_BITS"] == "4"
    assert env["LOCO_FEEDBACK"] == "0" and not formats.FORMATS[env["LOCO_FORMAT"]].feedback


def test_the_gap_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    long_report.plot_gaps(RUNS, tmp_path / "gaps.png")
    assert (tmp_path / "gaps.png").stat().st_size > 0
