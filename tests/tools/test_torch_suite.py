"""torch's own distributed suite over "loco": the curated subset over "loco" and gloo's run of
it, which defines the bar (both under ``-m slow``, 40-45 s each on 2 cores, and in `lowbitcc
torch-suite`); the comparison's rules are checked on made-up outcomes in the default suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowbitcc.tools.torch_suite import runner

REDUCING = [name for name in runner.CURATED
            if any(w in name for w in ("all_reduce_sum", "all_reduce_coalesced_sum", "allreduce",
                                       "DistributedDataParallel", "grads", "ddp", "static_graph",
                                       "get_future"))
            and "complex" not in name]
"""The curated tests that all-reduce real floating-point tensors by a sum: those forced
compression can change (MAX, complex values and `reduce` travel exact)."""


@pytest.mark.slow  # 40-45 s on 2 cores: with `-m slow`, beside gloo's run of the same slice
def test_curated_subset_of_torchs_suite_passes_over_loco(tmp_path):
    """The CI slice of `lowbitcc torch-suite`: "loco" passes every curated test (tests gloo
    passes: `test_gloo_passes_every_curated_test`) at the default settings, and with
    compression forced the reducing ones but lossy ones (`lowbitcc torch-suite` forces it on
    every curated test)."""
    assert set(runner.LOSSY_BY_DESIGN) & set(runner.CURATED) <= set(REDUCING)
    runs = {"loco": runner.run_config("loco", list(runner.CURATED), jobs=2, log_dir=tmp_path),
            "loco-forced": runner.run_config("loco-forced", REDUCING, jobs=2, log_dir=tmp_path)}
    comparisons = [runner.compare({"loco": runs["loco"]}, bar=set(runner.CURATED)),
                   runner.compare({"loco-forced": runs["loco-forced"]}, bar=set(REDUCING))]
    logs = {c: r.log.read_text()[-3000:] for c, r in runs.items()}
    assert all(c.ok for c in comparisons), (f"{[c.problems for c in comparisons]}; "
                                            f"ranks' logs: {logs}")
    assert runs["loco"].passed() == set(runner.CURATED)
    assert set(comparisons[1].lossy) <= set(runner.LOSSY_BY_DESIGN)


@pytest.mark.slow
def test_gloo_passes_every_curated_test(tmp_path):
    """The bar the subset is held to: gloo passes every curated test (about 20 s)."""
    run = runner.run_config("gloo", list(runner.CURATED), jobs=2, log_dir=tmp_path)
    assert run.passed() == set(runner.CURATED), run.outcomes


def _run(config: str, **outcomes: str) -> runner.SuiteRun:
    return runner.SuiteRun(config, {name: {"outcome": o, "detail": f"{o} because", "seconds": 1.0}
                                    for name, o in outcomes.items()}, 1.0, Path("log"))


def test_comparison_holds_loco_to_every_test_gloo_passes():
    refused = next(iter(runner.REFUSED_BY_TORCH))
    runs = {
        "gloo": _run("gloo", test_a="passed", test_b="passed", test_c="skipped",
                     **{refused: "passed"}),
        "loco": _run("loco", test_a="passed", test_b="skipped", test_c="failed",
                     **{refused: "failed"}),
    }
    comparison = runner.compare(runs)
    assert not comparison.ok
    assert comparison.problems == ["loco: test_b skipped (skipped because)"]
    assert comparison.refused == [f"loco: {refused}"]
    report = runner.format_report(runs, comparison, 2)
    assert "| loco | 1 | 2 | 1 |" in report and "loco: test_b skipped" in report


def test_comparison_forgives_lossy_tests_only_when_compression_is_forced(monkeypatch):
    monkeypatch.setattr(runner, "LOSSY_BY_DESIGN", {"test_a": "4-bit codes"})
    runs = {"gloo": _run("gloo", test_a="passed"), "loco": _run("loco", test_a="failed"),
            "loco-forced": _run("loco-forced", test_a="failed")}
    comparison = runner.compare(runs)
    assert comparison.problems == ["loco: test_a failed (failed because)"]
    assert comparison.lossy == ["test_a"]
    del runs["loco"]
    assert runner.compare(runs).ok
