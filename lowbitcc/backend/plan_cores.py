"""`make_core`: the C++ core of a call place's plan (``PlanCore``, ``backend/csrc/plan_core.h``),
which serves the place's steady compressed all-reduce without Python (the group's
``SteadyRunner`` runs it, `steady_runner`).

A plan gets a core where its runs are the direct schedule's two-rank all-gather of one chunk
(``schedules/direct.py``) on the CPU, with the settings the core implements: the C++ codec, no
error feedback (the default format's setting), nearest rounding, an op whose input factor is
fixed (SUM, AVG), an fp32, bf16 or fp16 tensor, over a metered gloo transport. The core keeps
the plan's own buffers (its messages, received messages and decode scratch) and writes what
the plan's Python run writes, byte for byte; where a message of a run does not belong to the
call it hands the decode back to the plan (`call_plan.CallPlan.finish_received`), so the
errors are the Python path's. Every other plan has none (``core`` None) and runs in Python.
"""

from __future__ import annotations

from typing import Any

import torch

from lowbitcc.backend import native
from lowbitcc.codec import cpu, wire
from lowbitcc.codec.abi import FORMAT_CODES
from lowbitcc.schedules.chunking import chunks
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.metered import MeteredTransport

CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The tensor dtypes a core encodes (the C++ codec's)."""


def make_core(plan: Any) -> None:
    """Give ``plan`` (a `call_plan.CallPlan` that has run once: its input factor is known) its
    ``core``: a ``PlanCore`` where one serves it (see the module docstring), else None; and
    mark it ``core_checked``. Called once per plan, by the runner, with the GIL held."""
    plan.core_checked = True
    plan.core = _core(plan)


def _core(plan: Any) -> Any:
    module, codec_module = native.load(), cpu.load()
    spec = None if module is None or codec_module is None else core_spec(plan)
    if spec is None:
        return None
    return module.PlanCore(plan.transport.inner.group, spec, codec_module.codec_api)


def core_spec(plan: Any) -> dict[str, Any] | None:
    """What a ``PlanCore`` of ``plan`` is made of (None: the plan has none, see the module
    docstring):

    - ``plan`` (kept by a weak reference), ``messages`` (uint8 ``[2, P]``), ``nonfinite``,
      ``received`` (uint8 ``[2 * 2 * P]``), ``scratch`` (fp32 ``[m]``): the plan and the buffers
      its stage "gather" keeps;
    - ``header``: the call's message header, its call number overwritten at ``seq_offset`` by
      each run; ``bits``, ``group_size``, ``format`` (`abi.FORMAT_CODES`), ``used``,
      ``checksum``, ``step``: the codec's;
    - ``dtype``, ``numel``, ``m``, ``world``, ``factor`` (the op's input factor), ``beta``:
      the call's;
    - ``modelled``, ``size_class``, ``nbytes``, ``logical_bytes``, ``intra_node_bytes``,
      ``inter_node_bytes``: what a run counts (the cost model's class; `counters.RunTally`'s
      bytes, the transport's metering).
    """
    codec, comp, world = plan._own_codec, plan.comp, plan.transport
    if (codec is None or plan.collective != "all_reduce" or plan.group.size != 2
            or plan.schedule != "direct" or plan.graph is not None
            or comp.error_dtype is not None or plan._factor is None
            or plan.codec_dtype not in CORE_DTYPES or codec.kernels is not cpu.KERNELS
            or codec.rounding != "nearest" or type(world) is not MeteredTransport
            or type(world.inner) is not GlooTransport
            or len(chunks(plan.m, plan.chunk, codec.group_size)) != 1):
        return None
    device, m, rows = plan.device, plan.m, plan.group.size
    kept = plan.kept_buffers
    messages, nonfinite = kept.messages("gather", rows, m, codec, device)
    intra, inter = world._to_peers(messages.numel())
    return {
        "plan": plan, "messages": messages, "nonfinite": nonfinite,
        "received": kept.received("gather", world.size * messages.numel(), device),
        "scratch": kept.fp32(m, device),
        "header": codec.header(m), "seq_offset": wire.SEQ_OFFSET, "bits": codec.bits,
        "group_size": codec.group_size, "format": FORMAT_CODES[codec.fmt],
        "used": wire.used_bytes(m, codec.bits, codec.group_size, codec.fmt),
        "checksum": codec.checksum, "step": cpu.CHECKSUM_STEP,
        "dtype": plan.codec_dtype, "numel": plan.numel, "m": m, "world": rows,
        "factor": plan._factor, "beta": comp.beta,
        "modelled": plan.modelled, "size_class": plan.size_class, "nbytes": plan.nbytes,
        "logical_bytes": plan.logical_bytes, "intra_node_bytes": intra,
        "inter_node_bytes": inter,
    }
