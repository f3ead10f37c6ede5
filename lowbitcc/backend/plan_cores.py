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
(`whole_runs.tree`), and so does one of the ring schedule (``schedules/ring.py``, on two ranks or
more, in chunks or not: `whole_runs.ring`), and one of the hierarchical schedule
(``schedules/hierarchical.py``, on two nodes or more of two ranks or more, over gloo node and
rail groups: `whole_runs.hier`, the node's exact steps, around the direct schedule's pieces on
the rail): its run is the schedule's, whole on its issuing thread (the group's issue lane,
``backend/csrc/issue_lane.h``, or the calling thread: inline, or a synchronous call). Every other
plan (a CUDA plan's, one whose hierarchical schedule has one node or one rank a node) has none
(``core`` None) and runs in Python.

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
from lowbitcc.backend import gloo_threads, native, whole_runs
from lowbitcc.codec import cpu, wire
from lowbitcc.codec.abi import ERROR_MODES, FORMAT_CODES
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.schedules import hierarchical
from lowbitcc.schedules.chunking import chunks, stage
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.metered import MeteredTransport

CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The tensor dtypes a core encodes (the C++ codec's)."""


def make_core(plan: Any) -> None:
    """Give ``plan`` (a `call_plan.CallPlan` that has run once: its input factor is known) its
    ``core``: a ``PlanCore`` where one serves it (see the module docstring), else None; and
    mark it ``core_checked`` (not a hierarchical plan whose node and rail links its runs have not
    made yet: asked again at its next run). Called once per plan, by the runner, with the GIL
    held."""
    if plan.schedule == "hierarchical" and not plan.links.made():
        return
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
    if spec["hier"] is not None:  # what its Python decodes read: the rail's transfers
        plan.core_kept = ("hier", spec["hier"]["partial"])
    plan.core = module.PlanCore(spec["transport"].inner.group, spec, codec_module.codec_api,
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
    - ``tree``: a tree schedule's run (`whole_runs.tree`; then no ``pieces``), else None;
      ``ring``: a ring schedule's (`whole_runs.ring`), else None; ``hier``: a hierarchical
      schedule's node steps (`whole_runs.hier`), else None: its ``pieces`` are then its
      rail's, the direct schedule's over the rail link (``world`` the nodes, ``rank`` this
      rank's node, ``numel`` the nodes' rows of ``m``, ``dtype`` fp32 and ``factor`` 1: the
      rail encodes the node's exact sums);
    - ``transport``: the link its pieces, tree or ring travel on (the world's, or the rail's);
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
    if not _served(plan):
        return None
    codec, comp, m = plan._own_codec, plan.comp, plan.m
    world, rows, rank, hier = plan.transport, plan.group.size, plan.group.rank, None
    if plan.schedule == "hierarchical":
        rail = _rail(plan)
        if rail is None:
            return None
        world, rows, rank, hier = rail
    ranges, pieces, tree, ring = _transfers(plan, rows)
    return {
        "plan": plan, "pieces": pieces, "tree": tree, "ring": ring, "hier": hier,
        "transport": world,
        "scratch": plan.kept_buffers.fp32(max(b - a for a, b in ranges), plan.device),
        **_codec_entries(codec),
        "collective": plan.collective, "m": m, "world": rows, "rank": rank, "beta": comp.beta,
        "dtype": torch.float32 if hier else plan.codec_dtype,
        "numel": rows * m if hier else plan.numel, "factor": 1.0 if hier else plan._factor,
        "modelled": plan.modelled, "size_class": plan.size_class, "nbytes": plan.nbytes,
        "logical_bytes": plan.logical_bytes, "same_node": list(world._same_node),
        "feedback": _feedback(plan),
    }


def _served(plan: Any) -> bool:
    """Whether a core may serve ``plan`` (the module docstring's settings; a hierarchical
    schedule's nodes are `core_spec`'s to check)."""
    codec = plan._own_codec
    return not (codec is None or plan.collective not in ("all_reduce", "reduce_scatter")
                or (plan.group.size < 2 and plan.collective == "all_reduce")
                or plan.schedule not in ("direct", "tree", "ring", "hierarchical")
                or plan.graph is not None
                or (plan.schedule == "ring" and plan.group.size < 2)
                or plan._factor is None
                or plan.codec_dtype not in CORE_DTYPES or codec.kernels is not cpu.KERNELS
                or codec.rounding != "nearest" or not _gloo(plan.transport))


def _rail(plan: Any) -> tuple[Any, int, int, dict[str, Any]] | None:
    """A hierarchical ``plan``'s rail link, its size and this rank's place in it, and its node
    steps (`whole_runs.hier`), where a core serves it: two nodes or more of two ranks or more,
    over gloo (else None: one node is exact, one rank a node the direct schedule's runs), its
    node and rail links made (by its runs: making one is collective, so a core never makes
    one; `make_core` asks again later)."""
    lay = plan.links.layout
    if (not lay.regular or lay.nodes < 2 or lay.node_size < 2 or not plan.links.made()
            or not _gloo(plan.links.node()) or not _gloo(plan.links.rail())):
        return None
    return plan.links.rail(), lay.nodes, lay.node, whole_runs.hier(plan)


def _codec_entries(codec: Any) -> dict[str, Any]:
    """`core_spec`'s entries of ``codec`` (a `ShardCodec`): its messages' call number's and
    flags' offsets and its peer-error flag (`wire`'s), its bits, group size, format
    (`abi.FORMAT_CODES`), checksum and the checksum's step."""
    return {
        "seq_offset": wire.SEQ_OFFSET, "flags_offset": wire.FLAGS_OFFSET,
        "peer_error_flag": wire.FLAG_PEER_ERROR, "bits": codec.bits,
        "group_size": codec.group_size, "format": FORMAT_CODES[codec.fmt],
        "checksum": codec.checksum, "step": cpu.CHECKSUM_STEP,
    }


def _gloo(link: Any) -> bool:
    """Whether ``link`` is a gloo group metered as the core meters it (`MeteredTransport`)."""
    return type(link) is MeteredTransport and type(link.inner) is GlooTransport


def _transfers(plan: Any, rows: int) -> tuple[list[tuple[int, int]], list[dict[str, Any]],
                                             dict[str, Any] | None, dict[str, Any] | None]:
    """``plan``'s chunks' columns, and its transfers over them between ``rows`` ranks
    (`core_spec`'s ``pieces``, ``tree`` and ``ring``: the direct schedule's pieces, the
    hierarchical schedule's its rail's, else a tree's or a ring's run)."""
    m, codec = plan.m, plan._own_codec
    ranges = chunks(m, plan.chunk, codec.group_size) if plan.schedule != "tree" else [(0, m)]
    return (ranges, *_transfers_over(plan, ranges, rows))


def _transfers_over(plan: Any, ranges: list[tuple[int, int]], rows: int
                    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any] | None]:
    """`_transfers`' transfers over ``ranges``."""
    scattered = plan.collective == "reduce_scatter" or rows > 2  # a first phase's all-to-all
    if plan.schedule == "tree":
        return [], whole_runs.tree(plan), None
    if plan.schedule == "ring":
        return [], None, whole_runs.ring(plan, ranges)
    prefix = hierarchical.PREFIX if plan.schedule == "hierarchical" else ""
    return _pieces(plan, ranges, scattered, rows, prefix), None, None


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


def _pieces(plan: Any, ranges: list[tuple[int, int]], scattered: bool, rows: int,
            prefix: str) -> list[dict[str, Any]]:
    """``plan``'s transfers (`core_spec`'s ``pieces``) between ``rows`` ranks for its chunks'
    columns ``ranges``, their stages named after ``prefix`` (the direct schedule's inside
    another's, `direct.all_reduce`'s): a first phase's all-to-all per chunk where ``scattered``
    (a reduce-scatter, an all-reduce on more than two ranks: with its second phase), else the
    two ranks' all-gathers."""
    m = plan.m
    if scattered:  # `direct._pipeline`: chunk k's rows are "rs.k.row"
        name = prefix + "rs"
        pieces = ([_piece(plan, name, 0, rows, 0, m, scattered, rows)] if len(ranges) == 1 else
                  [_scattered_chunk(plan, stage(name, k, len(ranges)), a, b, rows)
                   for k, (a, b) in enumerate(ranges)])
        if plan.collective == "all_reduce":  # the second phase: chunk k's stage is "ag.k"
            for k, piece in enumerate(pieces):
                _second_phase(plan, piece, stage(prefix + "ag", k, len(ranges)), rows)
        return pieces
    name = prefix + "gather"
    if len(ranges) == 1:
        return [_piece(plan, name, 0, rows, 0, m, scattered, rows)]
    # `direct._gather_all_reduce`'s stages: chunk k's row r is "gather.k.r"
    return [_piece(plan, f"{stage(name, k, len(ranges))}.{r}", r, 1, a, b, scattered, rows)
            for k, (a, b) in enumerate(ranges) for r in range(rows)]


def _piece(plan: Any, name: str, row0: int, rows: int, a: int, b: int,
           scattered: bool, world: int) -> dict[str, Any]:
    """One transfer between ``world`` ranks of ``plan``'s core that one encode writes: stage
    ``name``'s buffers (`compressor.CallCompressor`'s ``encode`` and ``received`` ask for the
    same), ``rows`` rows from ``row0``, columns ``a .. b``, sent by an all-to-all where
    ``scattered`` (`_pieces`), else all-gathered (see `core_spec`)."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
    messages, nonfinite = kept.messages(name, rows, b - a, codec, device)
    # an all-to-all receives a row from every rank, an all-gather every rank's rows
    received = messages.numel() if scattered else world * messages.numel()
    return {
        "row0": row0, "rows": rows, "a": a, "b": b, "sent": messages,
        "encodes": [{"row0": row0, "rows": rows, "messages": messages, "nonfinite": nonfinite,
                     "stage": name, "state_numel": rows * codec.padded(b - a)}],
        "received": kept.received(name, received, device),
        "header": codec.header(b - a),
        "used": wire.used_bytes(b - a, codec.bits, codec.group_size, codec.fmt),
    }


def _scattered_chunk(plan: Any, name: str, a: int, b: int, rows: int) -> dict[str, Any]:
    """A reduce-scatter's transfer between ``rows`` ranks of chunk stage ``name`` (columns
    ``a .. b``): each row encoded with its own stage ``name.row`` (`chunking.encode_row`) into
    its row of the core's ``sent``, which the schedule makes by concatenating the rows'
    messages (see `core_spec`)."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
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


def _second_phase(plan: Any, piece: dict[str, Any], name: str, rows: int) -> None:
    """Add to ``piece``, a chunk's all-to-all of an all-reduce on ``rows`` > 2 ranks, the
    buffers of its second phase, stage ``name``: this rank's message of the reduced row and its
    non-finite bytes (`CallCompressor.encode` of one row asks for the same) and the all-gather's
    received buffer (see `core_spec`)."""
    codec, kept, device = plan._own_codec, plan.kept_buffers, plan.device
    again, nonfinite = kept.messages(name, 1, piece["b"] - piece["a"], codec, device)
    piece.update(again=again, again_nonfinite=nonfinite,
                 again_received=kept.received(name, rows * again.numel(), device),
                 again_stage=name, again_state_numel=codec.padded(piece["b"] - piece["a"]))
