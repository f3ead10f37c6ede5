"""The wide study (`lowbitcc study --wide`): its tasks, its resumable runner (with the training
replaced by a recorder), its report and its choice of the default by the worst cell; a real
two-configuration smoke run in ``-m slow``."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from lowbitcc.tools.study import tasks, wide, wide_plans, wide_report
from lowbitcc.tools.study.variants import CONFIGURATIONS, VARIANTS, StudyConfig


def _run(configuration, world, seed, variant, loss, accuracy=None):
    record = {"configuration": configuration, "world": world, "seed": seed, "variant": variant,
              "val_loss": [[0, 9.0], [300, loss]], "seconds": 1.0}
    if accuracy is not None:
        record["val_accuracy"] = [[0, 0.1], [300, accuracy]]
    return record


def test_every_configuration_builds_its_task_and_a_mismatched_pair_is_refused():
    pytest.importorskip("sklearn")
    for name in CONFIGURATIONS:
        job = tasks.task(wide.config(name, 2, 3))
        x, y = next(iter(job.train_batches(seed=0, rank=1)))
        assert len(x) == len(y) == job.cfg.batch
        assert float(job.loss(job.model(), x, y).detach()) > 0
    with pytest.raises(ValueError, match="no task trains model 'cnn' on data 'stdlib'"):
        tasks.task(StudyConfig(model="cnn"))


def test_digits_validation_is_the_same_797_images_however_it_is_cut():
    pytest.importorskip("sklearn")
    job = tasks.task(wide.config("digits-cnn", 2, 5))
    four, eight = job.val_batches(4), job.val_batches(8)
    assert sum(len(y) for _, y in four) == sum(len(y) for _, y in eight) == tasks.DIGITS_VAL
    assert [int(y.sum()) for _, y in four][0] == int(eight[0][1].sum() + eight[1][1].sum())
    train = list(job.train_batches(seed=3, rank=0))
    again = list(job.train_batches(seed=3, rank=0))
    other = list(job.train_batches(seed=3, rank=1))
    assert len(train) == 5 and all((a[1] == b[1]).all() for a, b in zip(train, again, strict=True))
    assert any((a[1] != b[1]).any() for a, b in zip(train, other, strict=True))
    model = job.model()
    assert sum(p.numel() for p in model.parameters()) == 1_070_218
    x, y = four[0]
    assert 0 <= job.correct(model, x, y) <= len(y)


def test_report_pairs_seeds_with_their_exact_and_the_worst_cell_chooses(monkeypatch):
    # "steady" is better on average, "flat" in its worst cell: the worst cell decides
    runs = []
    losses = {("a", 2): {"steady": (1.000, 1.002), "flat": (1.002, 1.002)},
              ("b", 2): {"steady": (1.010, 1.012), "flat": (1.002, 1.003)},
              ("a", 4): {"steady": (1.000, 1.000), "flat": (1.002, 1.002)}}
    for (c, w), by_variant in losses.items():
        for seed in (0, 1):
            runs.append(_run(c, w, seed, "exact", 1.0 + seed))
            for variant, pair in by_variant.items():
                runs.append(_run(c, w, seed, variant, pair[seed] * (1.0 + seed)))
    rows = {(r["configuration"], r["world"], r["variant"]): r for r in wide_report.cell_rows(runs)}
    steady_b = rows[("b", 2, "steady")]
    assert steady_b["each"] == pytest.approx([0.010, 0.012])
    assert steady_b["mean_gap"] == pytest.approx(0.011)
    assert steady_b["se"] == pytest.approx(0.001)
    monkeypatch.setattr(wide_report, "bits", {"steady": 4.25, "flat": 4.5}.get)
    verdict = wide_report.choose(list(rows.values()))
    assert [r["variant"] for r in verdict["ranking"]] == ["flat", "steady"]
    assert verdict["chosen"] == "flat"
    assert verdict["ranking"][0]["worst_cell"] == ("b", 2)
    assert verdict["ranking"][0]["worst_gap"] == pytest.approx(0.0025)
    assert verdict["within_goal"] is True


def test_report_pairs_a_format_with_its_no_feedback_twin_and_refuses_wide_formats():
    runs = []
    for seed, (fb, nofb, ag8) in enumerate([(1.001, 1.004, 1.0), (1.003, 1.004, 1.0),
                                             (1.002, 1.006, 1.0)]):
        runs += [_run("digits-cnn", 2, seed, "exact", 1.0, accuracy=0.97),
                 _run("digits-cnn", 2, seed, "mxfp4", fb, accuracy=0.96),
                 _run("digits-cnn", 2, seed, "mxfp4-nofb", nofb, accuracy=0.97),
                 _run("digits-cnn", 2, seed, "lab-mxfp4-ag8", ag8, accuracy=0.97)]
    runs.append(_run("digits-cnn", 2, 5, "mxfp4", 1.0))  # no exact of seed 5: left out
    rows = {r["variant"]: r for r in wide_report.cell_rows(runs)}
    mx = rows["mxfp4"]
    assert mx["seeds"] == [0, 1, 2]
    assert mx["vs_twin"] == pytest.approx((-0.003 - 0.001 - 0.004) / 3)
    assert mx["vs_twin_se"] > 0
    assert mx["accuracy_gap"] == pytest.approx(-0.01)
    assert "vs_twin" not in rows["mxfp4-nofb"]
    assert wide_report.bits("lab-mxfp4-ag8") > wide_report.MAX_BITS
    verdict = wide_report.choose(list(rows.values()))
    assert "lab-mxfp4-ag8" not in [r["variant"] for r in verdict["ranking"]]
    assert verdict["chosen"] == "mxfp4"
    assert verdict["no_worse_than_twin"] is True
    text = wide_report.format_markdown(runs)
    assert "**digits-cnn, 2 ranks**" in text and "accuracy vs exact" in text
    assert "Best by its worst cell: **mxfp4**" in text


def test_the_runner_resumes_where_it_stopped(tmp_path, monkeypatch):
    calls = []

    def fake_run_variant(variant, cfg, seed, threads=None):
        calls.append((cfg.data, cfg.world, seed, variant.name))
        if len(calls) == 3 and not (tmp_path / "stop").exists():
            (tmp_path / "stop").touch()
            raise KeyboardInterrupt  # the study interrupted during its third run
        return {"variant": variant.name, "seed": seed, "val_loss": [[cfg.steps, 1.0 + seed]],
                "seconds": 2.0, "final_params": "not kept"}

    def fake_tracking(names, cfg, seed):
        calls.append(("tracking", cfg.data, cfg.world))
        return {"seed": seed, "series": {n: {"step_error": [0.1]} for n in names},
                "summary": [{"variant": n} for n in names]}

    monkeypatch.setattr(wide, "run_variant", fake_run_variant)
    monkeypatch.setattr(wide.tracking, "run", fake_tracking)
    monkeypatch.setattr(wide.tracking, "plot", lambda *a, **k: None)
    plan = wide_plans.Plan(("gpt", "gpt-docs"), (2,), (0, 1), ("exact", "mxfp4"), ("mxfp4",), steps=7)
    with pytest.raises(KeyboardInterrupt):
        wide.run(plan, tmp_path, jobs=1)
    assert len(calls) == 3  # no run started after the one that raised
    saved = json.loads((tmp_path / "wide.json").read_text())
    assert [(r["configuration"], r["seed"], r["variant"]) for r in saved["runs"]] == [
        ("gpt", 0, "exact"), ("gpt", 0, "mxfp4")]  # seed 0 of every cell first
    assert all("final_params" not in r for r in saved["runs"])
    calls.clear()
    results = wide.run(plan, tmp_path, jobs=1)
    assert calls[0] == ("pydoc", 2, 0, "exact")  # the interrupted run, and nothing before it
    assert len([c for c in calls if c[0] != "tracking"]) == 6
    assert [c for c in calls if c[0] == "tracking"] == [("tracking", "stdlib", 2),
                                                          ("tracking", "pydoc", 2)]
    assert len(results.data["runs"]) == 8 and len(results.data["tracking"]) == 2
    calls.clear()
    wide.run(plan, tmp_path, jobs=1)
    assert calls == []  # all done: nothing runs again
    assert wide.Results(tmp_path).seconds("gpt", 2) == pytest.approx(2.0 * 1.15)
    assert wide.Results(tmp_path).seconds("digits-cnn", 4) == pytest.approx(
        wide.SECONDS_HERE[("digits-cnn", 2)] * wide.FOUR_RANKS)


def test_every_candidate_has_its_twin_and_fits_the_bit_budget():
    for name in wide_plans.CANDIDATES:
        assert wide_report.bits(name) <= wide_report.MAX_BITS, name
        assert name.endswith("-nofb") or wide_report.twin(name) in wide_plans.CANDIDATES, name
    assert set(wide_plans.SCREENED_OUT) <= set(VARIANTS) and not set(wide_plans.SCREENED_OUT) & set(
        wide_plans.CANDIDATES)
    for name, plan in wide_plans.PLANS.items():
        assert plan.variants[0] == "exact"
        assert set(plan.configurations) <= set(CONFIGURATIONS)
        assert set(plan.variants) <= set(VARIANTS), name
    assert set(wide_plans.PLANS["full"].configurations) == set(CONFIGURATIONS)
    long = wide_plans.PLANS["long"]
    assert long.steps == 10 * wide_plans.PLANS["full"].steps and long.worlds == (2, 4)
    assert set(long.configurations) == {"gpt", "gpt-docs"} and len(long.seeds) == 3
    assert not math.isnan(wide_report.bits("mxfp4"))
    # every long-form variant has its bits; a feedback variant of a format is paired with the
    # format's no-feedback twin
    assert all(not math.isnan(wide_report.bits(v)) for v in long.variants)
    import argparse

    from lowbitcc.tools.study import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser.add_subparsers())
    for form in wide_plans.PLANS:  # `lowbitcc study --wide FORM`'s choices
        assert parser.parse_args(["study", "--wide", form]).wide == form
    assert wide_report.twin("nvfp4-warm1000") == wide_report.twin("nvfp4") == "nvfp4-nofb"
    assert wide_report.bits("loco4-g64") == 4.5 and wide_report.bits("exact") == 32.0
    # the long form's noise floor sends 16 bits, so the choice of the default never takes it
    assert wide_report.bits("fp16-hook") == 16.0 > wide_report.MAX_BITS
    assert "fp16-hook" in long.variants


@pytest.mark.slow  # trains 10 steps per run; `pytest -m slow`
def test_a_small_wide_study_runs_end_to_end(tmp_path, capfd):
    pytest.importorskip("sklearn")
    plan = wide_plans.Plan(("gpt", "digits-cnn"), (2,), (0,), ("exact", "mxfp4", "lab-nvfp4"),
                     ("mxfp4", "lab-nvfp4"), steps=10, eval_every=5)
    results = wide.run(plan, tmp_path)
    runs = results.data["runs"]
    assert len(runs) == 6
    # its stderr a pipe, rank 0 of each run says how far it is at each evaluation
    progress = re.findall(r"(exact|mxfp4|lab-nvfp4) seed 0, 2 ranks: step (\d+)/10, "
                          r"validation loss \d+\.\d+, \d+ s$", capfd.readouterr().err, re.M)
    assert sorted(progress) == sorted((v, s) for v in ("exact", "mxfp4", "lab-nvfp4")
                                      for s in ("5", "10") for _ in range(2)), progress
    digits = [r for r in runs if r["configuration"] == "digits-cnn"]
    assert all(0.0 <= r["val_accuracy"][-1][1] <= 1.0 for r in digits)
    rows = wide_report.cell_rows(runs)
    assert {(r["configuration"], r["variant"]) for r in rows} == {
        (c, v) for c in ("gpt", "digits-cnn") for v in ("mxfp4", "lab-nvfp4")}
    assert all(abs(r["mean_gap"]) < 0.05 for r in rows), rows
    for t in results.data["tracking"]:
        for row in t["summary"]:
            assert 0.9 < row["step_cosine"] <= 1.0, row
            assert 0 < row["step_error"] < 0.5, row
            assert row["worst_tensor"] in t["per_tensor"][row["variant"]]


def test_cells_limit_a_wide_plan_to_the_cells_named_in_its_own_order():
    """``--cells gpt:4``: every seed and variant of that cell, in the plan's order, and none of
    another cell; a cell the plan lacks, or ``--cells`` without ``--wide``, raises, naming it."""
    import argparse

    from lowbitcc.tools.study import command

    long = wide_plans.PLANS["long"]
    only = dataclasses.replace(long, only=wide_plans.parse_cells(long, ["gpt:4"]))
    assert only.cells() == [("gpt", 4)]
    assert only.runs() == [r for r in long.runs() if r[:2] == ("gpt", 4)]
    assert len(only.runs()) == len(long.seeds) * len(long.variants)
    two = wide_plans.parse_cells(long, ["gpt-docs:4", "gpt:2"])
    assert dataclasses.replace(long, only=two).cells() == [("gpt", 2), ("gpt-docs", 4)]
    for bad in ("gpt:8", "digits-cnn:2", "gpt", "gpt:x"):
        with pytest.raises(ValueError, match=f"--cells '{bad}' is not a cell of this plan"):
            wide_plans.parse_cells(long, [bad])
    parser = argparse.ArgumentParser()
    command.add_arguments(parser.add_subparsers())
    args = parser.parse_args(["study", "--cells", "gpt:4"])
    with pytest.raises(ValueError, match="--cells and --merge are a --wide plan's"):
        args.func(args)


def test_merge_adds_what_other_parts_of_the_study_finished_and_runs_only_what_none_did(
        tmp_path, monkeypatch):
    """``--merge A B``: the runs and trackings of other study folders that ``--out`` lacks are
    added first (``--out``'s own kept where both ran one), so only what no part finished runs;
    a part with runs of another length is refused before anything is added."""
    def record(world, seed, variant, loss, steps=7):
        return {"configuration": "gpt", "world": world, "seed": seed, "variant": variant,
                "val_loss": [[0, 9.0], [steps, loss]], "seconds": 1.0}

    def part(name, runs, tracking=()):
        (tmp_path / name).mkdir()
        (tmp_path / name / "wide.json").write_text(
            json.dumps({"runs": runs, "tracking": list(tracking)}))
        return str(tmp_path / name)

    out = part("out", [record(2, 0, "exact", 2.0)])
    a = part("a", [record(2, 0, "exact", 5.0), record(2, 0, "mxfp4", 2.1)],
             [{"configuration": "gpt", "world": 2, "seed": 0, "summary": []}])
    b = part("b", [record(2, 1, "exact", 2.2)])
    long = part("long", [record(2, 1, "exact", 2.5), record(2, 1, "mxfp4", 2.3, steps=3000)])
    calls = []

    def fake_run_variant(variant, cfg, seed, threads=None):
        calls.append((seed, variant.name))
        return {"variant": variant.name, "seed": seed, "val_loss": [[cfg.steps, 2.4]],
                "seconds": 1.0, "final_params": None}

    monkeypatch.setattr(wide, "run_variant", fake_run_variant)
    monkeypatch.setattr(wide_report, "plot_frontier", lambda *a, **k: None)
    plan = wide_plans.Plan(("gpt",), (2,), (0, 1), ("exact", "mxfp4"), (), steps=7)
    monkeypatch.setitem(wide.PLANS, "tiny", plan)
    with pytest.raises(ValueError, match="holds a run of 3000 steps .*not this plan's 7"):
        wide.command("tiny", out, merge=[a, long])
    assert calls == []
    saved = json.loads((tmp_path / "out" / "wide.json").read_text())
    assert len(saved["runs"]) == 2  # a's mxfp4, added before; nothing of long's, not its exact
    with pytest.raises(ValueError, match="--merge found no .*nowhere"):
        wide.command("tiny", out, merge=[str(tmp_path / "nowhere")])
    wide.command("tiny", out, merge=[a, b])
    assert calls == [(1, "mxfp4")]  # what no part finished
    saved = json.loads((tmp_path / "out" / "wide.json").read_text())
    by_key = {(r["seed"], r["variant"]): r["val_loss"][-1][1] for r in saved["runs"]}
    assert by_key == {(0, "exact"): 2.0, (0, "mxfp4"): 2.1, (1, "exact"): 2.2,
                      (1, "mxfp4"): 2.4}  # out's own exact seed 0 kept, not a's
    assert len(saved["tracking"]) == 1
    assert wide.Results(tmp_path / "out").merge(tmp_path / "b" / "wide.json", 7) == 0


def test_variants_and_seeds_narrow_a_wide_plan_in_its_own_order():
    """``--variants exact nvfp4-nofb --seeds 2 1``: only those runs of the plan, seed by seed and
    in the plan's variant order, whatever order they were named in; a name or seed the plan
    lacks raises, naming the plan's; none given keeps the plan."""
    long = wide_plans.PLANS["long"]
    narrow = wide_plans.narrowed(long, ["nvfp4-nofb", "exact"], [2, 1])
    assert narrow.runs() == [r for r in long.runs()
                             if r[3] in ("exact", "nvfp4-nofb") and r[2] in (1, 2)]
    assert [r[2:] for r in narrow.runs()[:2]] == [(1, "exact"), (1, "nvfp4-nofb")]
    assert wide_plans.narrowed(long) == long
    with pytest.raises(ValueError, match="variant 'int2' is not one of this plan's .*exact"):
        wide_plans.narrowed(long, ["exact", "int2"])
    with pytest.raises(ValueError, match="seed 7 is not one of this plan's"):
        wide_plans.narrowed(long, None, [7])
