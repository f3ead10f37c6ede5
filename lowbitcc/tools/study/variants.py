"""The study's variants (what each training run varies) and its configuration."""

from __future__ import annotations

import dataclasses

from lowbitcc.codec import formats as codec_formats
from lowbitcc.tools.study.formats import LAB_VARIANTS


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training run: backend, the ``LOCO_*`` settings of the "loco" group, DDP hook, FSDP,
    or DiLoCo-style training (``outer_every`` H > 0: no DDP, each rank a site with its own
    inner optimizer, `lowbitcc.OuterSync` over the default group every H steps, compressed
    always on "loco", exact on gloo).

    Every loco variant compresses every gradient call (``LOCO_COST_MODEL=0``): the study
    measures what compression does to training, not which calls a cost model would pick. A
    loco variant keeps error feedback on unless its ``env`` names ``LOCO_FEEDBACK`` (the
    "-nofb" twins), whatever the library's per-format default (`LocoConfig.wire_feedback`)."""

    name: str
    backend: str = "gloo"
    env: tuple[tuple[str, str], ...] = ()
    hook: str | None = None  # "fp16", "powersgd" or "lab" (`formats.lab_hook`)
    fsdp: bool = False
    outer_every: int = 0
    outer_lr: float = 0.7  # DiLoCo's outer SGD: learning rate and Nesterov momentum
    outer_momentum: float = 0.5  # DiLoCo uses 0.9 at H = 500; docs/wan.md
    feedback_warmup: int = 0
    """Steps at the start of the run without error feedback: after each of them the error
    states are dropped (`lowbitcc.state.FEEDBACK`), so that its calls quantize the gradients
    alone, as the "-nofb" twin's do; from then on LoCo as the variant's ``env`` sets it."""

    def __post_init__(self) -> None:
        if self.backend != "loco":
            return
        for name, value in (("LOCO_COST_MODEL", "0"), ("LOCO_FEEDBACK", "1")):
            if not any(k == name for k, _ in self.env):
                object.__setattr__(self, "env", (*self.env, (name, value)))


THE_DEFAULT = "nvfp4-nofb"
"""The variant that trains as lowbitcc's defaults do: NVFP4 (``LOCO_FORMAT=auto``'s first
choice at 4 bits) without error feedback (that format's default); what reports compare the
others with."""

INT = ("LOCO_FORMAT", "int")
"""The "loco*" variants keep int codes: they name what they measured before MXFP4 became the
4-bit default (docs/convergence.md); the "mxfp4*" variants MXFP4, the default before NVFP4."""
MX = ("LOCO_FORMAT", "mxfp4")
NV = ("LOCO_FORMAT", "nvfp4")
THREE_BIT = ("nvint3", "nvfp3")
"""The codec's 3-bit formats (3.53 bits per element, docs/wire-format.md): each a variant with
LoCo and its ``-nofb`` twin."""
OUTER_EVERY = (10, 50)
"""The H (inner steps per outer step) of the DiLoCo variants."""

VARIANTS = {
    v.name: v for v in [
        Variant("exact"),
        Variant("mxfp4", "loco", (MX, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"))),
        Variant("mxfp4-ef", "loco", (MX, ("LOCO_BITS", "4"), ("LOCO_BETA", "0"))),
        Variant("mxfp4-nofb", "loco", (MX, ("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0"))),
        Variant("nvfp4", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"))),
        Variant("nvfp4-nofb", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0"))),
        Variant("nvfp4-ef", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_BETA", "0"))),
        Variant("nvfp4-fp32e", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"),
                                        ("LOCO_ERROR_DTYPE", "fp32"))),
        Variant("nvfp4-reset50", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"),
                                          ("LOCO_RESET_INTERVAL", "50"))),
        *(Variant(f"nvfp4-warm{n}", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8")),
                  feedback_warmup=n) for n in (100, 1000)),
        *(v for fmt in THREE_BIT for v in (
            Variant(fmt, "loco", (("LOCO_FORMAT", fmt), ("LOCO_BITS", "3"),
                                  ("LOCO_BETA", "0.8"))),
            Variant(f"{fmt}-nofb", "loco", (("LOCO_FORMAT", fmt), ("LOCO_BITS", "3"),
                                            ("LOCO_FEEDBACK", "0"))))),
        Variant("fsdp2-mxfp4", "loco", (MX, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8")),
                fsdp=True),
        Variant("loco4", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"))),
        Variant("loco4-ef", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_BETA", "0"))),
        Variant("loco4-nofb", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0"))),
        Variant("loco4-g64", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"),
                                      ("LOCO_GROUP_SIZE", "64"))),
        Variant("loco8", "loco", (("LOCO_BITS", "8"), ("LOCO_BETA", "0.8"))),
        Variant("int8-nofb", "loco", (INT, ("LOCO_BITS", "8"), ("LOCO_FEEDBACK", "0"))),
        Variant("loco2", "loco", (("LOCO_BITS", "2"), ("LOCO_BETA", "0.8"))),
        Variant("loco2-nofb", "loco", (("LOCO_BITS", "2"), ("LOCO_FEEDBACK", "0"))),
        Variant("loco4-g1024", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"),
                                        ("LOCO_GROUP_SIZE", "1024"))),
        Variant("loco4-g1024-nofb", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0"),
                                             ("LOCO_GROUP_SIZE", "1024"))),
        Variant("loco4-g64-nofb", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0"),
                                           ("LOCO_GROUP_SIZE", "64"))),
        Variant("fp16-hook", hook="fp16"),
        Variant("powersgd", hook="powersgd"),
        Variant("fsdp2-loco4", "loco", (INT, ("LOCO_BITS", "4"), ("LOCO_BETA", "0.8")),
                fsdp=True),
        *(Variant(name, hook="lab") for name in LAB_VARIANTS),
        *(v for h in OUTER_EVERY for v in (
            Variant(f"diloco-fp32-h{h}", outer_every=h),
            Variant(f"diloco-int8-h{h}", "loco", (INT, ("LOCO_BITS", "8"),
                                                  ("LOCO_FEEDBACK", "0")), outer_every=h),
            Variant(f"diloco-4bit-h{h}", "loco", (MX, ("LOCO_BITS", "4"),
                                                  ("LOCO_FEEDBACK", "0")), outer_every=h),
            Variant(f"diloco-loco4-h{h}", "loco", (MX, ("LOCO_BITS", "4"),
                                                   ("LOCO_BETA", "0.8")), outer_every=h))),
    ]
}
DILOCO_VARIANTS = ["exact", "mxfp4", *(n for n in VARIANTS if n.startswith("diloco-"))]
"""`lowbitcc study --diloco` (`lowbitcc.tools.study.diloco`): DDP every step over gloo fp32
(``exact``, the reference) and over loco (``mxfp4``), and DiLoCo with outer sync in fp32, int8
without feedback (what INTELLECT-1 sends), 4-bit without feedback and 4-bit LoCo, at each H."""
_OUTER_BITS = [
    v for h in OUTER_EVERY for v in (
        Variant(f"diloco-int2-h{h}", "loco", (INT, ("LOCO_BITS", "2"), ("LOCO_FEEDBACK", "0")),
                outer_every=h),
        Variant(f"diloco-loco2-h{h}", "loco", (INT, ("LOCO_BITS", "2"), ("LOCO_BETA", "0.8")),
                outer_every=h),
        Variant(f"diloco-nvfp4-h{h}", "loco", (NV, ("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0")),
                outer_every=h),
        Variant(f"diloco-nvfp4-loco-h{h}", "loco", (NV, ("LOCO_BITS", "4"),
                                                    ("LOCO_BETA", "0.8")), outer_every=h),
        *(v for fmt in THREE_BIT for v in (
            Variant(f"diloco-{fmt}-h{h}", "loco", (("LOCO_FORMAT", fmt), ("LOCO_BITS", "3"),
                                                   ("LOCO_FEEDBACK", "0")), outer_every=h),
            Variant(f"diloco-{fmt}-loco-h{h}", "loco", (("LOCO_FORMAT", fmt), ("LOCO_BITS", "3"),
                                                        ("LOCO_BETA", "0.8")), outer_every=h))))]
VARIANTS.update({v.name: v for v in _OUTER_BITS})
OUTER_BITS_VARIANTS = [v.name for v in _OUTER_BITS]
"""Outer syncs at 2 to 4 bits beside `DILOCO_VARIANTS` (``lowbitcc study --diloco --variants
...``; not in its default set): int2 codes (one fp32 scale per 128, 2.25 bits), the 3-bit
`THREE_BIT` formats under NVFP4's two-level scales (3.53 bits) and NVFP4 (4.53 bits), each without
feedback and with LoCo, at every H. `diloco.fewest_bits` reads them."""


def wire_bits(name: str) -> float:
    """Wire bits per element of variant ``name``'s compressed calls: a format lab variant's
    spec's; a "loco" variant's format (its ``LOCO_FORMAT``, else ``auto``'s choice,
    `lowbitcc.codec.formats.auto`) at its code width and group size, scales included
    (`Format.wire_bits`); 16 for torch's fp16 compression hook; 32 for a variant that sends
    fp32 (gloo, the PowerSGD hook's factors, DiLoCo's fp32 outer sync)."""
    if name in LAB_VARIANTS:
        return LAB_VARIANTS[name].bits_per_element
    variant = VARIANTS[name]
    if variant.hook == "fp16":
        return 16.0
    if variant.backend != "loco":
        return 32.0
    env = dict(variant.env)
    bits, group = int(env.get("LOCO_BITS", "4")), int(env.get("LOCO_GROUP_SIZE", "0"))
    name = env.get("LOCO_FORMAT", "auto")
    if name == "auto":
        name = codec_formats.auto(bits, env.get("LOCO_ROUNDING", "nearest"), group)
    return codec_formats.FORMATS[name].wire_bits(bits, group)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Model, data and schedule of a study (defaults: the documented study's GPT).

    ``model`` and ``data`` name what trains (`lowbitcc.tools.study.tasks`): the byte-level GPT
    (``d_model``, ``layers``, ``heads``, ``context``) on ``"stdlib"`` (the standard library's
    Python sources) or ``"pydoc"`` (the standard library's English documentation topics), or
    the convolutional classifier ``"cnn"`` on scikit-learn's ``"digits"`` (``context`` and the
    GPT's sizes unused). ``batch`` is per rank and per step."""

    model: str = "gpt"
    data: str = "stdlib"
    steps: int = 300
    batch: int = 16  # sequences per rank per step
    context: int = 64
    d_model: int = 192
    layers: int = 4
    heads: int = 4
    lr: float = 2e-3
    warmup: int = 20
    eval_every: int = 25
    # validation batches of each evaluation during training and of the final one (rounded up to
    # a multiple of ``world``: each rank evaluates its share)
    eval_batches: int = 16
    final_eval_batches: int = 128
    corpus_bytes: int = 4 << 20
    world: int = 2


CONFIGURATIONS: dict[str, dict[str, object]] = {
    "gpt": {},
    "gpt-docs": {"data": "pydoc", "d_model": 256, "layers": 6, "heads": 8, "batch": 8,
                 "lr": 1e-3, "warmup": 40},
    "digits-cnn": {"model": "cnn", "data": "digits", "batch": 32, "lr": 1e-3, "eval_batches": 4,
                   "final_eval_batches": 8},
}
"""The wide study's three configurations (`lowbitcc.tools.study.wide`), as `StudyConfig`
fields: the documented study's GPT; a wider and deeper GPT (4.8 M parameters) with another
learning rate, batch and warm-up on another text; a convolutional classifier (1.07 M parameters)
on scikit-learn's handwritten digits, with accuracy beside the loss."""

# `lowbitcc study` with no names: the default format with and without feedback over 3 seeds, the
# former int4 default, FSDP2 and torch's hooks once: 13 runs, under 30 minutes on 2 cores
# (docs/convergence.md); the other variants are the sweeps' (their commands are there too)
DEFAULT_VARIANTS = ["exact", "mxfp4", "mxfp4-nofb", "loco4", "fp16-hook", "powersgd",
                    "fsdp2-mxfp4"]
DEFAULT_SEEDS = [0, 1, 2]
EXTRA_SEED_VARIANTS = ["exact", "mxfp4", "mxfp4-nofb"]
DEFAULT_TRACKED = ["mxfp4", "mxfp4-nofb", "loco4", "loco2"]
# the smoke run of the test suite: a tiny model and little data
QUICK = {"d_model": 64, "layers": 2, "heads": 2, "batch": 8, "context": 32, "eval_every": 10,
         "eval_batches": 4, "final_eval_batches": 32, "corpus_bytes": 1 << 20}



def check_trackable(names: list[str]) -> None:
    """Raise `ValueError` unless every name is a DDP-over-"loco" or format-lab variant (what
    tracking runs)."""
    trackable = [n for n, v in VARIANTS.items()
                 if (v.backend == "loco" or v.hook == "lab") and not v.fsdp and not v.outer_every]
    bad = [n for n in names if n not in trackable]
    if bad:
        raise ValueError(f"lowbitcc study: cannot track {bad}; trackable: {trackable}")

