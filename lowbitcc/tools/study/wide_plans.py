"""What a wide study runs (`lowbitcc study --wide FORM`): its forms' plans (`PLANS`) and the
variants they compare; `wide` runs them. Kept apart from the runner so that the command's parser
takes its choices from here without importing it."""

from __future__ import annotations

import dataclasses

from lowbitcc.tools.study.variants import CONFIGURATIONS, THREE_BIT, StudyConfig

CANDIDATES = ("mxfp4", "mxfp4-nofb", "nvfp4", "nvfp4-nofb")
"""The formats compared (each with its no-feedback twin, the name plus ``-nofb``): the codec's
MXFP4 (the default until the study chose NVFP4 without feedback) and NVFP4 (docs/wire-format.md)."""
SCREENED_OUT = ("lab-mxfp4-had32", "lab-mxfp4-had32-nofb", "lab-nvfp4", "lab-nvfp4-nofb")
"""Candidates of the first runs that the whole study stopped running. MXFP4 after a Hadamard
rotation of each block of 32, with and without feedback, ended further from exact than MXFP4
itself in each of the first three cells it ran (seed 0 of gpt at 2 and 4 ranks and gpt-docs at
2 ranks: +0.20/+1.18/+0.10% against +0.12/+0.81/+0.07%) at the format lab's 2.5x cost in run
time here. The format lab's NVFP4 ran seed 0 of every cell; the codec's "nvfp4" (its fp32
scale per stage replaced by an E8M0 byte per 16 groups) runs every seed in its place. Their
runs stay in ``wide.json`` and its tables; the choice skips a variant that did not run in
every cell."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a wide study runs: every variant (``exact`` first) of every configuration at every
    world size and seed, and the ``tracked`` variants on the first seed of each cell."""

    configurations: tuple[str, ...]
    worlds: tuple[int, ...]
    seeds: tuple[int, ...]
    variants: tuple[str, ...]
    tracked: tuple[str, ...]
    steps: int = 300
    eval_every: int = StudyConfig.eval_every
    """Steps between the evaluations during a run (the gap-against-step curves' points)."""
    only: tuple[tuple[str, int], ...] = ()
    """The cells ``(configuration, world)`` to run, of those the plan has (empty: every one):
    a study that asks one cell's seeds first (``--cells``)."""

    def runs(self) -> list[tuple[str, int, int, str]]:
        """``(configuration, world, seed, variant)`` in the order they run: seed by seed (a
        study stopped early has every cell's first seeds), then cell by cell, each exact run
        before its candidates."""
        return [(c, w, s, v) for s in self.seeds for c, w in self.cells()
                for v in self.variants]

    def cells(self) -> list[tuple[str, int]]:
        return [(c, w) for c in self.configurations for w in self.worlds
                if not self.only or (c, w) in self.only]


def parse_cells(plan: Plan, specs: list[str]) -> tuple[tuple[str, int], ...]:
    """``--cells`` values (``CONFIGURATION:WORLD``, e.g. ``gpt:4``) as `Plan.only`; a cell the
    plan does not have raises a `ValueError` naming the plan's cells."""
    cells, have = [], plan.cells()
    for spec in specs:
        configuration, _, world = spec.partition(":")
        cell = (configuration, int(world)) if world.isdigit() else None
        if cell is None or cell not in have:
            names = ", ".join(f"{c}:{w}" for c, w in have)
            raise ValueError(f"lowbitcc study: --cells {spec!r} is not a cell of this plan "
                             f"({names})")
        cells.append(cell)
    return tuple(cells)


def narrowed(plan: Plan, variants: list[str] | None = None,
             seeds: list[int] | None = None) -> Plan:
    """``plan`` with only ``variants`` and ``seeds`` (``--variants`` and ``--seeds`` with
    ``--wide``; None: all of the plan's), in the plan's own order, so that a study asks the runs
    that decide first and resumes the rest later; a variant or seed the plan lacks raises a
    `ValueError` naming the plan's."""
    for given, have, what in ((variants, plan.variants, "variant"), (seeds, plan.seeds, "seed")):
        unknown = [g for g in given or () if g not in have]
        if unknown:
            names = " ".join(map(str, have))
            raise ValueError(f"lowbitcc study: {what} {unknown[0]!r} is not one of this plan's "
                             f"({names})")
    return dataclasses.replace(
        plan, variants=tuple(v for v in plan.variants if variants is None or v in variants),
        seeds=tuple(s for s in plan.seeds if seeds is None or s in seeds))


LONG_VARIANTS = ("exact", "nvfp4-nofb", "nvfp4", "mxfp4", "nvfp4-warm1000", "fp16-hook")
"""The long form's runs: fp32, the default (NVFP4 without feedback), NVFP4 with LoCo, MXFP4
with LoCo (the default until 2026-11-27), and NVFP4 with LoCo after a feedback warm-up of the
first third of the run (`Variant.feedback_warmup`: at 300 steps, 100 steps of warm-up ended as
low as no feedback; docs/convergence.md); last the noise floor: torch's fp16 compression hook,
whose 16-bit rounding is far below any 4-bit format's, shows how far a run's final loss moves
from exact's when its gradients are only nudged (a gap no larger than that one's cannot be told
from the run-to-run spread of a training whose trajectory a nudge changes)."""

FEEDBACK_VARIANTS = ("exact", "nvfp4-nofb", "nvfp4", "nvfp4-ef", "nvfp4-fp32e", "nvfp4-reset50",
                     "nvfp4-warm100")
"""The feedback form's runs (why NVFP4 with LoCo ends above NVFP4 without at 300 steps): LoCo
(beta 0.8) against classic error feedback (beta 0), an fp32 error state for int8's, error states
reset every 50 uses, and feedback after a warm-up of 100 steps."""
SECOND_PHASE_VARIANTS = ("exact", "nvfp4-nofb", "lab-nvfp4-nofb-rs-only", "lab-nvfp4-nofb-agfb",
                         "lab-nvfp4-nofb-agef")
"""The second-phase form's runs (why the default drifts at 4 ranks and not at 2, at 3000 steps):
beside fp32 and the default, the format lab's NVFP4 without feedback with its second
quantization (each reduced row again, for the all-gather, on three ranks or more) left out, or
kept with error feedback at the row's owner (LoCo, or classic error feedback). The lab is
faithful to the default (the tracking of gpt at 4 ranks: step error 13.69% against the codec's
13.64%)."""
DRIFT_VARIANTS = ("exact", "nvfp4-nofb", "fp16-hook", "int8-nofb", "lab-nvfp4-sr-nofb",
                  "lab-int6-nofb")
"""The drift form's runs (what the default's 4-rank gap at 3000 steps needs, beside the
second-phase form's): between the fp16 hook (the noise floor, within 0.2% of exact) and the
default's 4.53 bits, int8 codes without feedback (8.25 bits: whether more bits alone close the
gap), the format lab's 6-bit integer codes under NVFP4's scales without feedback (6.5 bits:
where between the two the gap closes) and its NVFP4 with stochastic rounding in both
quantizations, without feedback (the same bits, its rounding unbiased: whether the gap is
nearest rounding's bias)."""
THREE_BIT_VARIANTS = ("exact", *(f"{f}{fb}" for fb in ("-nofb", "") for f in THREE_BIT))
"""The three-bit form's runs: the codec's 3-bit formats without feedback and with LoCo."""

PLANS = {
    "full": Plan(tuple(CONFIGURATIONS), (2, 4), (0, 1, 2), ("exact", *CANDIDATES), CANDIDATES),
    "quick": Plan(tuple(CONFIGURATIONS), (2,), (0, 1), ("exact", "mxfp4", "nvfp4", "nvfp4-nofb"),
                  ()),
    "long": Plan(("gpt", "gpt-docs"), (2, 4), (0, 1, 2), LONG_VARIANTS, (), steps=3000,
                 eval_every=100),
    "feedback": Plan(("gpt",), (2,), (0, 1, 2), FEEDBACK_VARIANTS, ()),
    "three-bit": Plan(tuple(CONFIGURATIONS), (2, 4), (0, 1, 2), THREE_BIT_VARIANTS, ()),
    "second-phase": Plan(("gpt",), (4,), (0, 1, 2), SECOND_PHASE_VARIANTS, (), steps=3000,
                         eval_every=100),
    "drift": Plan(("gpt",), (4,), (0, 1, 2), DRIFT_VARIANTS, (), steps=3000, eval_every=100),
}
"""The forms of ``--wide``: ``full`` and ``quick`` at 300 steps; ``long`` at 3000 (ten times the
steps, the learning-rate schedule stretched to the run) on the two GPTs, evaluated every 100
steps so that the gap to exact can be followed over the run (`long_report.plot_gaps`);
``feedback`` (`FEEDBACK_VARIANTS` on the GPT at 2 ranks, its gap over the run too) and
``three-bit`` (`THREE_BIT_VARIANTS` in every cell) at 300 steps; ``second-phase``
(`SECOND_PHASE_VARIANTS`) and ``drift`` (`DRIFT_VARIANTS`) on the GPT at 4 ranks at the long
form's 3000 steps, so that their exact and default runs are the long form's where they share an
output folder."""
