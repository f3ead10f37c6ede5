"""`make_core`: the C++ core of a call place's plan (``PlanCore``, ``backend/csrc/plan_core.h``),
which serves the place's steady compressed all-reduce or reduce-scatter without Python (the
group's ``SteadyRunner`` runs it, `steady_runner`).

A plan gets a core where its runs are the direct schedule's (``schedules/direct.py``): an
all-reduce's on two ranks (its all-gather, `_gather_all_reduce`: one of both rows, or with chunks
one per row and chunk), a reduce-scatter's on any number (its all-to-all of every row per chunk,
`_pipeline`), an all-reduce's on more ranks (per chunk that all-to-all, then the all-gather of
each rank's message of its reduced row: `_pipeline` with its second phase, or
`_scatter_gather`); on the CPU, with the settings the core implements: the C++ codec, nearest
rounding, an op whose input factor is fixed (SUM, AVG), an fp32, bf16 or fp16 tensor, over a
metered gloo transport; with or without error feedback. The core keeps the plan's own buffers
(each transfer's messages and received messages, the decode scratch) and writes what the plan's
Python run writes, byte for byte; where a message of a run does not belong to the call it hands
the decode back to the plan (`call_plan.CallPlan.finish_received`, over ``core_received``), so
the errors are the Python path's. A plan of the tree schedule (``schedules/tree.py``, an
all-reduce or a reduce-scatter on any number of ranks, with the same settings) gets one too
(`_tree`), and so does one of the ring schedule (``schedules/ring.py``, on two ranks or more, in
chunks or not: `_ring`): its run is the schedule's, whole on its issuing thread (the group's issue
lane, ``backend/csrc/issue_lane.h``, or inline the calling thread). Every other plan
(the hierarchical schedule's, a CUDA plan's) has none (``core`` None) and runs in Python.

Error feedback. With feedback on, each encode of a run takes its error state from the plan's
`feedback.FeedbackStore` under the call's key and the encode's stage (`CallCompressor.encode`'s
``key|stage``) and the run puts it back, as the Python path does: the core's ``FeedbackSlots``
(``backend/csrc/feedback_slots.h``) take a steady state (kept, its buffer the call's, its size
the encode's) themselves, on the store's own containers and lock, and any other through
`take_state`, the store's own `take`; under a key derived from the call's position, or one
that a `lowbitcc.feedback_key` block names (its layout then not checked, as Python's). The
states go back once the run's encodes are done, before its last decodes: a run whose encodes
met a non-finite value puts none back (dropped, as the Python path drops them); the others carry
the run's verdict (`ErrorState.run_verdict`), which the core gives once the run is done: dropped
where a decode then met a non-finite value or a foreign message or a transfer failed (a message
the core's check refused that the Python plan's decodes accept after all, `finish_received`,
keeps them, as on the Python path). A state
whose verdict is dropped counts as dropped everywhere in the store, and a take of a state whose
run is not done waits for it (`feedback._void`), so the states are the Python path's, which
stores them at the call's end.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import state
from lowbitcc.backend import gloo_threads, native
from lowbitcc.codec import cpu, wire
from lowbitcc.codec.abi import ERROR_MODES, FORMAT_CODES
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.schedules.chunking import chunks, stage
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.metered import MeteredTransport

CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The tensor dtypes a core encodes (the C++ codec's)."""


def make_core(plan: Any) -> None:
    """Give ``plan`` (a `call_plan.CallPlan` that has run once: its input factor is known) its
    ``core``: a ``PlanCore`` where one serves it (see the module docstring), else None; and
    mark it ``core_checked``. Called once per plan, by the runner, with the GIL held."""
    plan.core_checked = True
    module, codec_module = native.load(), cpu.load()
    spec = None if module is None or codec_module is None else core_spec(plan)
    if spec is None:
        return
    plan.core_received = [(p["a"], p["b"], None if p["rows"] > 1 else p["row0"], p["received"])
                          for p in spec["pieces"]]
    plan.core_gathered = [p["again_received"] for p in spec["pieces"] if "again" in p]
    tree, ring = spec["tree"], spec["ring"]
    if tree is not None:  # what the tree's decodes read: its children's messages, the codes
        plan.core_kept = (tree.get("from_children"), tree.get("from_parent", tree["messages"]))
    if ring is not None:  # the ring's: what each step received, each chunk's gathered rows
        plan.core_kept = (ring["arrived"], [g["gathered"] for g in ring.get("gathers", [])],
                          [(c["a"], c["b"]) for c in ring["chunks"]])
    plan.core = module.PlanCore(plan.transport.inner.group, spec, codec_module.codec_api,
                                gloo_threads.park)
    state.STATS.watch("compressed", plan.core)  # a read of the statistics counts its seconds


def core_spec(plan: Any) -> dict[str, Any] | None:
    """What a ``PlanCore`` of ``plan`` is made of (None: the plan has none, see the module
    docstring):

    - ``plan`` (kept by a weak reference), ``scratch`` (fp32, the widest transfer's columns):
      the plan and its decode buffer;
    - ``pieces``: the schedule's transfers in its order, each a dict: the rows it carries
      ``row0`` .. ``row0 + rows`` and its columns ``a`` .. ``b``; ``encodes``, the encodes that
      write its messages (each a dict: its rows ``row0`` .. ``row0 + rows``, its ``messages``,
      uint8 ``[rows, P]``, ``nonfinite``, and the ``stage`` and ``state_numel`` of its error
      state), ``sent`` (uint8 ``[rows, P]``, the messages it
      sends) and ``received``, the buffers its stages keep (a reduce-scatter's chunk, whose rows
      the schedule encodes one by one and sends together, also a ``sent`` of the core's own);
      ``header``, its messages' header (its call number overwritten at ``seq_offset`` by each
      run); ``used``, its messages' used bytes; an all-reduce's on more than two ranks also
      ``again`` (uint8 ``[1, P]``) and ``again_nonfinite``, the buffers its second phase's
      encode writes (stage ``ag``'s; ``again_stage`` and ``again_state_numel``: its error
      state's), and ``again_received``, the all-gather's (``[world * P]``);
    - ``tree``: a tree schedule's run (`_tree`; then no ``pieces``), else None; ``ring``: a
      ring schedule's (`_ring`), else None;
    - ``flags_offset`` and ``peer_error_flag``: where a message's flags lie and the flag its
      encodes set once a message of the call did not belong to it (`wire`'s);
    - ``bits``, ``group_size``, ``format`` (`abi.FORMAT_CODES`), ``checksum``, ``step``: the
      codec's;
    - ``collective`` (``"all_reduce"``, ``"reduce_scatter"``), ``dtype``, ``numel``, ``m``,
      ``world``, ``rank``, ``factor`` (the op's input factor), ``beta``: the call's;
    - ``modelled``, ``size_class``, ``nbytes``, ``logical_bytes``: what a run counts (the cost
      model's class; `counters.RunTally`'s bytes); ``same_node``: by transport rank, whether it
      is on this rank's node (`MeteredTransport`'s: the core meters each transfer it starts, as
      the transport does, by its peers' nodes);
    - ``feedback``: its error feedback (`_feedback`), None where off.
    """
    codec, comp, world = plan._own_codec, plan.comp, plan.transport
    if (codec is None or plan.collective not in ("all_reduce", "reduce_scatter")
            or (plan.group.size < 2 and plan.collective == "all_reduce")
            or plan.schedule not in ("direct", "tree", "ring") or plan.graph is not None
            or (plan.schedule == "ring" and plan.group.size < 2)
            or plan._factor is None
            or plan.codec_dtype not in CORE_DTYPES or codec.kernels is not cpu.KERNELS
            or codec.rounding != "nearest" or type(world) is not MeteredTransport
            or type(world.inner) is not GlooTransport):
        return None
    m, rows = plan.m, plan.group.size
    ranges = chunks(m, plan.chunk, codec.group_size) if plan.schedule != "tree" else [(0, m)]
    scattered = plan.collective == "reduce_scatter" or rows > 2  # a first phase's all-to-all
    pieces, tree, ring = _transfers(plan, ranges, scattered)
    return {
        "plan": plan, "pieces": pieces, "tree": tree, "ring": ring,
        "scratch": plan.kept_buffers.fp32(max(b - a for a, b in ranges), plan.device),
        "seq_offset": wire.SEQ_OFFSET, "flags_offset": wire.FLAGS_OFFSET,
        "peer_error_flag": wire.FLAG_PEER_ERROR, "bits": codec.bits,
        "group_size": codec.group_size, "format": FORMAT_CODES[codec.fmt],
        "checksum": codec.checksum, "step": cpu.CHECKSUM_STEP,
        "collective": plan.collective, "dtype": plan.codec_dtype, "numel": plan.numel, "m": m,
        "world": rows, "rank": plan.group.rank, "factor": plan._factor, "beta": comp.beta,
        "modelled": plan.modelled, "size_class": plan.size_class, "nbytes": plan.nbytes,
        "logical_bytes": plan.logical_bytes, "same_node": list(world._same_node),
        "feedback": _feedback(plan),
    }


def _transfers(plan: Any, ranges: list[tuple[int, int]], scattered: bool
               ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """``plan``'s transfers over its chunks' columns ``ranges`` (`core_spec`'s ``pieces``,
    ``tree`` and ``ring``: the direct schedule's pieces, else a tree's or a ring's run)."""
    if plan.schedule == "tree":
        return [], _tree(plan), None
    if plan.schedule == "ring":
        return [], None, _ring(plan, ranges)
    return _pieces(plan, ranges, scattered), None, None


def _feedback(plan: Any) -> dict[str, Any] | None:
    """What ``plan``'s core needs of its error feedback (`core_spec`'s ``feedback``; None:
    off): the store (``store``), the error storage (``error_dtype``) and its ``mode``
    (`abi.ERROR_MODES`), ``reset_interval``, the keys' ``prefix`` and ``named_prefix``
    (`CompressedCalls.key_prefix`: a derived key's, which each call's ordinal completes, and a
    named key's, which the name of a `lowbitcc.feedback_key` block completes; each encode's
    ``|stage`` follows) and the slow path of a take (``take``: `take_state`)."""
    comp = plan.comp
    if comp.error_dtype is None:
        return None
    return {
        "store": comp.store, "error_dtype": comp.error_dtype, "mode": ERROR_MODES[comp.error_dtype],
        "reset_interval": comp.reset_interval,
        "prefix": plan.group.key_prefix(plan.collective, plan.codec_dtype, plan.numel),
        "named_prefix": plan.group.key_prefix(), "take": take_state,
    }


def take_state(store: Any, key: str, numel: int, error_dtype: str, reset_interval: int,
               group_size: int, tensor: torch.Tensor | None) -> tuple[ErrorState, int, bool]:
    """A core's take of error state ``key`` (``numel`` elements) where its C++ does not take it
    itself (a first use, another buffer, a size that changed: `feedback.FeedbackStore.take`'s
    other cases), for a call that reduces ``tensor`` (a derived key's: the layout is checked by
    its storage; None: a named key's, not checked): what `CallCompressor.encode` and
    `ShardCodec.encode` take, ``(state, uses, applied)``, where ``applied`` says the state is
    applied (else a new zero state the encode writes)."""
    buffer = None if tensor is None else StorageWeakRef(tensor.untyped_storage())
    state, uses = store.take(key, numel, error_dtype, reset_interval, "cpu", group_size, buffer)
    if state is None:
        return ErrorState.zeros(numel, error_dtype, group_size, "cpu"), 0, False
    return state, uses, True


def _pieces(plan: Any, ranges: list[tuple[int, int]], scattered: bool) -> list[dict[str, Any]]:
    """``plan``'s transfers (`core_spec`'s ``pieces``) for its chunks' columns ``ranges``: a
    first phase's all-to-all per chunk where ``scattered`` (a reduce-scatter, an all-reduce on
    more than two ranks: with its second phase), else the two ranks' all-gathers."""
    m, rows = plan.m, plan.group.size
    if scattered:  # `direct._pipeline`: chunk k's rows are "rs.k.row"
        pieces = ([_piece(plan, "rs", 0, rows, 0, m, scattered)] if len(ranges) == 1 else
                  [_scattered_chunk(plan, stage("rs", k, len(ranges)), a, b)
                   for k, (a, b) in enumerate(ranges)])
        if plan.collective == "all_reduce":  # the second phase: chunk k's stage is "ag.k"
            for k, piece in enumerate(pieces):
                _second_phase(plan, piece, stage("ag", k, len(ranges)))
        return pieces
    if len(ranges) == 1:
        return [_piece(plan, "gather", 0, rows, 0, m, scattered)]
    # `direct._gather_all_reduce`'s stages: chunk k's row r is "gather.k.r"
    return [_piece(plan, f"{stage('gather', k, len(ranges))}.{r}", r, 1, a, b, scattered)
            for k, (a, b) in enumerate(ranges) for r in range(rows)]


def _piece(plan: Any, name: str, row0: int, rows: int, a: int, b: int,
           scattered: bool) -> dict[str, Any]:
    """One transfer of ``plan``'s core that one encode writes: stage ``name``'s buffers
    (`compressor.CallCompressor`'s ``encode`` and ``received`` ask for the same), ``rows`` rows
    from ``row0``, columns ``a .. b``, sent by an all-to-all where ``scattered`` (`_pieces`),
    else all-gathered (see `core_spec`)."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
    messages, nonfinite = kept.messages(name, rows, b - a, codec, device)
    # an all-to-all receives a row from every rank, an all-gather every rank's rows
    received = messages.numel() if scattered else plan.group.size * messages.numel()
    return {
        "row0": row0, "rows": rows, "a": a, "b": b, "sent": messages,
        "encodes": [{"row0": row0, "rows": rows, "messages": messages, "nonfinite": nonfinite,
                     "stage": name, "state_numel": rows * codec.padded(b - a)}],
        "received": kept.received(name, received, device),
        "header": codec.header(b - a),
        "used": wire.used_bytes(b - a, codec.bits, codec.group_size, codec.fmt),
    }


def _scattered_chunk(plan: Any, name: str, a: int, b: int) -> dict[str, Any]:
    """A reduce-scatter's transfer of chunk stage ``name`` (columns ``a .. b``): each row
    encoded with its own stage ``name.row`` (`chunking.encode_row`) into its row of the core's
    ``sent``, which the schedule makes by concatenating the rows' messages (see `core_spec`)."""
    codec, kept, device, rows = plan._own_codec, plan.kept_buffers, plan.device, plan.group.size
    size = codec.message_bytes(b - a)
    sent = kept.get(f"core sent {name}", rows * size, torch.uint8, device).view(rows, size)
    encodes = []
    for r in range(rows):
        _, nonfinite = kept.messages(f"{name}.{r}", 1, b - a, codec, device)
        encodes.append({"row0": r, "rows": 1, "messages": sent[r:r + 1], "nonfinite": nonfinite,
                        "stage": f"{name}.{r}", "state_numel": codec.padded(b - a)})
    return {
        "row0": 0, "rows": rows, "a": a, "b": b, "sent": sent, "encodes": encodes,
        "received": kept.received(name, sent.numel(), device), "header": codec.header(b - a),
        "used": wire.used_bytes(b - a, codec.bits, codec.group_size, codec.fmt),
    }


def _second_phase(plan: Any, piece: dict[str, Any], name: str) -> None:
    """Add to ``piece``, a chunk's all-to-all of an all-reduce on more than two ranks, the
    buffers of its second phase, stage ``name``: this rank's message of the reduced row and its
    non-finite bytes (`CallCompressor.encode` of one row asks for the same) and the all-gather's
    received buffer (see `core_spec`)."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
    again, nonfinite = kept.messages(name, 1, piece["b"] - piece["a"], codec, device)
    piece.update(again=again, again_nonfinite=nonfinite,
                 again_received=kept.received(name, plan.group.size * again.numel(), device),
                 again_stage=name, again_state_numel=codec.padded(piece["b"] - piece["a"]))


def _tree(plan: Any) -> dict[str, Any]:
    """A tree schedule's run on this rank (`core_spec`'s ``tree``; `schedules.tree`): its
    ``children`` and ``parent`` (-1: the root); its one encode of every row, stage ``stage``
    ("tree.down" at the root, else "tree.up": the buffers `CallCompressor.encode` asks for),
    ``messages`` uint8 ``[world, P]`` and ``nonfinite``, with its error state's
    ``state_numel``; ``header`` and ``used`` (its messages'); where it has children
    ``partial`` (fp32 ``[world * m]``, the sums it encodes) and ``from_children`` (uint8
    ``[children, world, P]``), where it has a parent ``from_parent`` (uint8 ``[world, P]``, the
    root's codes), the buffers they are received into (the core's own)."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
    rows, rank, m = plan.group.size, plan.group.rank, plan.m
    children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < rows]
    parent = (rank - 1) // 2 if rank else -1
    name = "tree.down" if rank == 0 else "tree.up"
    messages, nonfinite = kept.messages(name, rows, m, codec, device)
    size = messages.shape[1]
    tree: dict[str, Any] = {
        "children": children, "parent": parent, "stage": name, "messages": messages,
        "nonfinite": nonfinite, "state_numel": rows * codec.padded(m), "header": codec.header(m),
        "used": wire.used_bytes(m, codec.bits, codec.group_size, codec.fmt),
    }
    if children:
        tree["partial"] = kept.get("core tree partial", rows * m, torch.float32, device)
        tree["from_children"] = kept.get("core tree children", len(children) * rows * size,
                                         torch.uint8, device).view(len(children), rows, size)
    if parent >= 0:
        tree["from_parent"] = kept.get("core tree parent", rows * size, torch.uint8,
                                       device).view(rows, size)
    return tree


def _ring(plan: Any, ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """A ring schedule's run on this rank (`core_spec`'s ``ring``; `schedules.ring`) over its
    chunks' columns ``ranges``: ``chunks``, each chunk's ``a``, ``b``, ``header`` and ``used``;
    ``steps[s][k]``, the encode step ``s`` sends of chunk ``k`` (stage ``ring.rs.s``'s buffers,
    as `CallCompressor.encode` asks for them: ``messages`` uint8 ``[1, P]``, ``nonfinite``,
    ``stage``, ``state_numel``); ``arrived[s][k]``, uint8 ``[P]``, what step ``s`` receives from
    the left; an all-reduce's ``gathers[k]``: chunk ``k``'s ``gathered`` (uint8 ``[world, P]``,
    every rank's reduced row, its own encoded in place with stage ``ring.ag``'s ``nonfinite``,
    ``stage`` and ``state_numel``); ``partial``, ``own`` (fp32, the widest chunk) and
    ``reduced`` (fp32 ``[m]``), the sums it makes; the core's own buffers but the messages'."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
    rows, m = plan.group.size, plan.m
    count, widest = len(ranges), max(b - a for a, b in ranges)
    ring: dict[str, Any] = {
        "chunks": [{"a": a, "b": b, "header": codec.header(b - a),
                    "used": wire.used_bytes(b - a, codec.bits, codec.group_size, codec.fmt)}
                   for a, b in ranges],
        "steps": [], "arrived": [],
        "partial": kept.get("core ring partial", widest, torch.float32, device),
        "own": kept.get("core ring own", widest, torch.float32, device),
        "reduced": kept.get("core ring reduced", m, torch.float32, device),
    }
    sizes = [codec.message_bytes(b - a) for a, b in ranges]
    for s in range(rows - 1):
        step = []
        for k, (a, b) in enumerate(ranges):
            name = stage(f"ring.rs.{s}", k, count)
            messages, nonfinite = kept.messages(name, 1, b - a, codec, device)
            step.append({"messages": messages, "nonfinite": nonfinite, "stage": name,
                         "state_numel": codec.padded(b - a)})
        ring["steps"].append(step)
        ring["arrived"].append([kept.get(f"core ring arrived {s}.{k}", size, torch.uint8, device)
                                for k, size in enumerate(sizes)])
    if plan.collective == "all_reduce":
        ring["gathers"] = []
        for k, (a, b) in enumerate(ranges):
            name = stage("ring.ag", k, count)
            _, nonfinite = kept.messages(name, 1, b - a, codec, device)
            gathered = kept.get(f"core ring gathered {k}", rows * sizes[k], torch.uint8,
                                device).view(rows, sizes[k])
            ring["gathers"].append({"gathered": gathered, "nonfinite": nonfinite, "stage": name,
                                    "state_numel": codec.padded(b - a)})
    return ring
