"""Configuration of the "loco" backend: one object, read from the environment once.

`LocoConfig` holds every knob. Each field has an environment variable of the same name in upper
case with the prefix ``LOCO_`` (``bits`` -> ``LOCO_BITS``). Precedence, lowest first: the defaults
below, then ``LOCO_*`` variables, then a `LocoConfig` passed as ``pg_options`` to
``init_process_group`` / ``new_group`` (which replaces the environment-derived config whole).
Values are validated when a `LocoConfig` is constructed (`from_env` for the environment, which
the process group reads when it is created); an invalid value raises `ValueError` naming the
field, the value and what is allowed. The allowed schedules, transports, codec kernels, error
storages and roundings are those of their registries (`lowbitcc.schedules.NAMES`,
`lowbitcc.transports.NAMES`, ...), not lists of this module.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from lowbitcc import schedules, transports
from lowbitcc.codec import formats
from lowbitcc.codec.abi import ERROR_STORAGES
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.kernels import CHOICES as CODECS
from lowbitcc.codec.reference import ROUNDINGS

ENV_PREFIX = "LOCO_"
POLICIES = ("backward", "always", "never")
BITS = tuple(sorted({b for f in formats.TABLE for b in f.bits}))
"""Every code width some format takes (`lowbitcc.codec.formats`): 2, 3, 4, 8."""
PARAM_BITS = FORMATS["int"].bits
"""The code widths of ``param_bits`` all-gathers, which travel as int codes: 2, 4, 8."""
FORMAT_CHOICES = ("auto", *FORMATS)
SCHEDULES = (*schedules.NAMES, "auto")
TRANSPORTS = ("auto", *transports.NAMES)
ISSUERS = ("auto", "inline")
"""How CPU reductions are issued (``LOCO_ISSUER``; `lowbitcc.backend.issuer`)."""


@dataclasses.dataclass(frozen=True)
class LocoConfig:
    """Knobs of LoCo compression for one process group.

    Attributes:
        bits: code width of compressed payloads (2, 4 or 8; 3 with "nvint3" or "nvfp3").
        format: the codes and scales of compressed payloads: "int" (symmetric integer codes,
            one fp32 scale per group), "mxfp4" (4-bit FP4 E2M1 codes, one power-of-two E8M0
            scale byte per group, nearest rounding only), "nvfp4" (4-bit FP4 E2M1 codes, one FP8
            E4M3 scale byte per group of 16 under one E8M0 byte per 16 groups, nearest rounding
            only; docs/wire-format.md), "nvint3" or "nvfp3" (3-bit codes, integer magnitudes
            0..3 or FP3 E2M0 magnitudes 0, 1, 2, 4, under NVFP4's scales, nearest rounding only)
            or "auto" (the default: "nvfp4" at 4 bits with nearest rounding and group size 0 or
            16, "mxfp4" at 4 bits with other group sizes, else "int"; `formats.auto`; it takes
            no 3-bit format: 3 bits name theirs). Read the resolved value from `wire_format`.
        group_size: elements sharing one scale, a multiple of 8; 0 (the default): the
            format's own, 32 for "mxfp4", 16 for "nvfp4", "nvint3" and "nvfp3" (their only one)
            and 128 for "int" (`group_for`).
        beta: LoCo moving-average factor of the error state, in [0, 1); 0 is classic error feedback.
        feedback: keep and apply an error state at all (False: plain quantization); None (the
            default, ``LOCO_FEEDBACK=auto``): the format's own (`formats.Format.feedback`), off
            for "nvfp4" (and "nvint3" and "nvfp3", as NVFP4) and on for "mxfp4" and "int", as
            the wide study found best
            (docs/convergence.md). Read the resolved value from `wire_feedback`.
        reset_interval: the error state of a key is zeroed every this many uses (0: never).
        error_dtype: storage of the error state: "int8" (per-group scales), "bf16" or "fp32".
        min_size: tensors with fewer elements than this travel exact.
        policy: which eligible calls are compressed: "backward" (calls issued while autograd runs
            a backward pass), "always" or "never".
        check: exchange a call descriptor (`exchange_frame.EXCHANGE_BYTES` per rank) before each
            all-reduce / reduce-scatter on CPU tensors, and before each one on CUDA tensors
            that could be compressed or has at least ``min_size`` elements, so that a size,
            dtype or op mismatch across ranks raises on every rank instead of hanging, and a
            call is compressed only if every rank would compress it.
        check_all: with ``check``, exchange a descriptor before the exact data movements on
            CPU tensors too (broadcast, all-gather, gather, scatter, all-to-all, barrier,
            reduce), so that any two kinds of collective that differ across ranks raise on every
            rank (an all-reduce against a broadcast: a hang on gloo). Off by default: it adds one
            small exchange to each such call (docs/reliability.md has the cost), which gloo and
            NCCL do not pay; torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is the like of it.
        cost_model: compress a call the policy allows only where compressing calls of its size
            has been faster than the exact call on this group (timed on real calls, rank 0's
            choice followed by every rank; `lowbitcc.cost_model`). Needs ``check``. False:
            every call the policy allows is compressed. A ``compressed()`` block forces
            compression either way.
        max_keys: the most error states kept per process (one per key and stage); the least
            recently used are dropped. The store is shared by every group of the process: its
            bound is the largest ``max_keys`` of the groups created (`lowbitcc.state`).
        codec: codec implementation: "auto" (fused C++ kernels when they build, else the
            reference), "reference" (pure torch) or "cpu" (the kernels, or fail).
        rounding: "nearest" (half to even) or "stochastic" (unbiased; counter-based random bits,
            the same on every implementation and reproducible from ``seed``).
        seed: seed of stochastic rounding's random stream (an integer in [0, 2**32)).
        param_bits: all-gathers of CPU float tensors of at least ``min_size`` elements per rank
            (the parameter all-gathers of FSDP and ZeRO-3) travel as this many bits per element
            (int codes: 2, 4 or 8) in groups of ``group_size``, without error feedback; every
            rank's output holds the same dequantized values (its own slot too), its input is
            untouched. 0 (the default): exact. Off within `lowbitcc.exact()` and under policy "never".
        checksum: compressed messages carry a 64-bit checksum of their scales and codes,
            verified on receipt: a message corrupted in transit (or in memory) raises
            ``WireFormatError`` instead of decoding into wrong values (docs/wire-format.md).
            None (the default, ``LOCO_CHECKSUM=auto``): on for CPU tensors, where it costs
            about 1-3% of a compressed call's codec time (docs/reliability.md), off for CUDA
            tensors, whose fused checksum kernels have not been run or timed on a GPU yet
            (`checksum_for`). True or False: on or off for both. Off,
            messages keep their size (and a zero trailer) and nothing is verified.
        schedule: the compressed reduce-scatter/all-reduce schedule (see docs/algorithms.md):
            "direct" (one all-to-all of codes, then one all-gather), "ring" (neighbours only,
            re-quantized at each hop), "tree" (binary tree, for small messages),
            "hierarchical" (exact inside a node, compressed across nodes) or "auto" (by size,
            ranks and node layout; see the ``auto_*`` thresholds).
        transport: what compressed schedules send the codes of CPU tensors over: "gloo"
            (TCP), "mpi" (mpi4py; ranks started by mpiexec) or "auto" (gloo). CUDA tensors
            always go over the group's inner NCCL group ("nccl" names that, and means gloo for
            CPU tensors). Exact calls run on the inner gloo group (CPU) or NCCL group (CUDA).
        node_size: ranks per node for the hierarchical schedule (consecutive global ranks);
            0 takes the launcher's LOCAL_WORLD_SIZE, or one node for every rank without it.
            Set it to emulate several nodes on one machine.
        auto_tree_bytes: "auto" picks the tree for calls below this many input bytes per rank
            (from ``auto_tree_ranks`` ranks on).
        auto_tree_ranks: the fewest ranks for which "auto" picks the tree.
        auto_ring_ranks: "auto" picks the ring from this many ranks on (0: never).
        chunk_size: elements per row in one pipelined chunk of a compressed schedule (rounded up
            to a multiple of ``group_size``): transfers of chunk k overlap the codec work of its
            neighbours; 0 sends each phase as one message. With nearest rounding the results are the
            same bytes either way (stochastic rounding draws other random bits per chunk).
        max_chunks: the most chunks a row is cut into: a row longer than ``max_chunks *
            chunk_size`` gets wider chunks, so that a large call pays the host work of a chunk
            fewer times (0: no limit, ``chunk_size`` alone decides).
        issuer: how CPU reductions are issued: "auto" (the group's worker thread: the caller
            goes on while a call runs) or "inline" (in the calling thread, as CUDA calls always
            are: less host time per synchronous call, the caller waiting for each; it also runs
            the CUDA path's logic on CPU tensors with the C++ kernels). CUDA reductions are
            issued inline either way.
        call_graphs: a CUDA place whose compressed entry runs without error feedback on the
            direct schedule captures its run in CUDA graphs at its third and fourth runs and
            replays them from then on (`lowbitcc.backend.place_graph`; the ranks agree on it,
            as NCCL requires); without it such a place records its run's launches and NCCL
            transfers once, on the host, and issues them again from the record while its
            tensors keep their addresses (`lowbitcc.backend.launch_record`). Off by default:
            its first GPU run did not finish (docs/gpu.md; ``LOCO_CALL_GRAPHS=1``).
    """

    bits: int = 4
    format: str = "auto"
    group_size: int = 0
    beta: float = 0.8
    feedback: bool | None = None
    reset_interval: int = 1024
    error_dtype: str = "int8"
    min_size: int = 65536
    policy: str = "backward"
    check: bool = True
    check_all: bool = False
    cost_model: bool = True
    max_keys: int = 4096
    codec: str = "auto"
    rounding: str = "nearest"
    seed: int = 0
    param_bits: int = 0
    checksum: bool | None = None
    schedule: str = "direct"
    chunk_size: int = 1048576
    max_chunks: int = 8
    transport: str = "auto"
    node_size: int = 0
    auto_tree_bytes: int = 2097152
    auto_tree_ranks: int = 4
    auto_ring_ranks: int = 0
    issuer: str = "auto"
    call_graphs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def wire_format(self) -> str:
        """The code format of compressed reductions: ``format``, with "auto" resolved."""
        if self.format != "auto":
            return self.format
        return formats.auto(self.bits, self.rounding, self.group_size)

    @property
    def wire_feedback(self) -> bool:
        """Whether compressed reductions keep and apply an error state: ``feedback``, or where
        it is None the wire format's own (`formats.Format.feedback`)."""
        return FORMATS[self.wire_format].feedback if self.feedback is None else self.feedback

    def group_for(self, fmt: str) -> int:
        """Elements per scale for payloads in format ``fmt``: ``group_size``, or the format's
        default when it is 0."""
        return self.group_size or FORMATS[fmt].default_group

    @property
    def wire_group_size(self) -> int:
        """Elements per scale of compressed reductions (`group_for` of `wire_format`)."""
        return self.group_for(self.wire_format)

    def checksum_for(self, device_type: str) -> bool:
        """Whether compressed messages of ``device_type`` tensors carry checksums: ``checksum``,
        or where it is None (auto) on for "cpu" and off for other devices."""
        return self.checksum if self.checksum is not None else device_type == "cpu"

    @property
    def _timeout(self) -> None:
        """c10d's backend options carry a ``_timeout``, and ``init_device_mesh`` reads it from
        the ``pg_options`` of a ``backend_override`` entry; None: the group's default."""
        return None

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field."""

        def bad(field: str, allowed: str) -> ValueError:
            value = getattr(self, field)
            return ValueError(
                f"lowbitcc: invalid {field}={value!r} ({ENV_PREFIX}{field.upper()}): "
                f"expected {allowed}"
            )

        if not _is_int(self.bits) or self.bits not in BITS:
            raise bad("bits", "one of " + ", ".join(map(str, BITS)))
        if self.format not in FORMAT_CHOICES:
            raise bad("format", "one of " + ", ".join(FORMAT_CHOICES))
        if self.format == "auto" and not formats.auto_takes(self.bits):
            takes = " or ".join(repr(name) for name in formats.taking(self.bits))
            raise bad("format", f"{takes} with bits={self.bits} (format 'auto' takes no "
                      f"{self.bits}-bit codes: name the format)")
        if self.format != "auto" and self.bits not in FORMATS[self.format].bits:
            takes = [*formats.taking(self.bits), *(["auto"] if formats.auto_takes(self.bits) else [])]
            raise bad("format", f'{" or ".join(f"{t!r}" for t in takes)} with '
                      f"bits={self.bits} ({self.format} codes are "
                      f"{'/'.join(map(str, FORMATS[self.format].bits))} bits)")
        if not _is_int(self.group_size) or self.group_size < 0 or self.group_size % 8:
            raise bad("group_size", "0 (the format's default) or a positive multiple of 8")
        if self.group_size > 1 << 20:
            raise bad("group_size", "at most 1048576")
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float):
            raise bad("beta", "a number in [0, 1)")
        if not 0.0 <= float(self.beta) < 1.0:
            raise bad("beta", "a number in [0, 1)")
        if self.feedback is not None and not isinstance(self.feedback, bool):
            raise bad("feedback", "a bool, or None for the format's own")
        if not _is_int(self.reset_interval) or self.reset_interval < 0:
            raise bad("reset_interval", "an integer >= 0 (0 disables resets)")
        if self.error_dtype not in ERROR_STORAGES:
            raise bad("error_dtype", "one of " + ", ".join(ERROR_STORAGES))
        if not _is_int(self.min_size) or self.min_size < 1:
            raise bad("min_size", "an integer >= 1")
        if self.policy not in POLICIES:
            raise bad("policy", "one of " + ", ".join(POLICIES))
        if not isinstance(self.check, bool):
            raise bad("check", "a bool")
        if not isinstance(self.check_all, bool) or (self.check_all and not self.check):
            raise bad("check_all", "a bool, and false when check is false")
        if not isinstance(self.cost_model, bool):
            raise bad("cost_model", "a bool")
        if not _is_int(self.max_keys) or self.max_keys < 1:
            raise bad("max_keys", "an integer >= 1")
        if self.codec not in CODECS:
            raise bad("codec", "one of " + ", ".join(CODECS))
        if self.rounding not in ROUNDINGS:
            raise bad("rounding", "one of " + ", ".join(ROUNDINGS))
        if self.format != "auto" and self.rounding not in FORMATS[self.format].roundings:
            allowed = " or ".join(f'"{r}"' for r in FORMATS[self.format].roundings)
            raise bad("rounding", f'{allowed} with format="{self.format}"')
        fixed = FORMATS[self.wire_format]
        if fixed.fixed_group and self.group_size not in (0, fixed.default_group):
            raise bad("group_size", f"0 or {fixed.default_group} with format="
                      f'"{self.wire_format}" (its groups are {fixed.default_group} elements)')
        if not _is_int(self.seed) or not 0 <= self.seed < 1 << 32:
            raise bad("seed", "an integer in [0, 2**32)")
        if not _is_int(self.param_bits) or self.param_bits not in (0, *PARAM_BITS):
            raise bad("param_bits", "0 (exact) or one of " + ", ".join(map(str, PARAM_BITS)))
        if self.checksum is not None and not isinstance(self.checksum, bool):
            raise bad("checksum", "a bool, or None for auto")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", "one of " + ", ".join(SCHEDULES))
        if not _is_int(self.chunk_size) or self.chunk_size < 0:
            raise bad("chunk_size", "an integer >= 0 (0: no pipelining)")
        if not _is_int(self.max_chunks) or self.max_chunks < 0:
            raise bad("max_chunks", "an integer >= 0 (0: no limit)")
        if not isinstance(self.call_graphs, bool):
            raise bad("call_graphs", "a bool")
        if self.issuer not in ISSUERS:
            raise bad("issuer", "one of " + ", ".join(ISSUERS))
        if self.transport not in TRANSPORTS:
            raise bad("transport", "one of " + ", ".join(TRANSPORTS))
        for field in ("node_size", "auto_tree_bytes", "auto_tree_ranks", "auto_ring_ranks"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 0:
                raise bad(field, "an integer >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LocoConfig:
        """Build a config from the defaults overridden by ``LOCO_*`` variables.

        Unknown ``LOCO_*`` variables raise, so that a typo is not silently ignored.
        """
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, raw in environ.items():
            if not name.startswith(ENV_PREFIX):
                continue
            field = name[len(ENV_PREFIX):].lower()
            if field not in fields:
                known = ", ".join(ENV_PREFIX + f.upper() for f in fields)
                raise ValueError(f"lowbitcc: unknown environment variable {name}; known: {known}")
            values[field] = _parse(field, fields[field].type, raw)
        return cls(**values)

    def replace(self, **changes: Any) -> LocoConfig:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse(field: str, type_name: Any, raw: str) -> Any:
    text = raw.strip()
    try:
        if type_name in ("int", int):
            return int(text)
        if type_name in ("float", float):
            return float(text)
        if type_name == "bool | None" and text.lower() == "auto":
            return None
        if type_name in ("bool", bool, "bool | None"):
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
    except ValueError:
        raise ValueError(
            f"lowbitcc: invalid {ENV_PREFIX}{field.upper()}={raw!r}: expected "
            + ("a bool or auto" if type_name == "bool | None" else f"a {type_name}")
        ) from None
    return text.lower()
