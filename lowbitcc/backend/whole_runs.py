"""What a plan core's runs off the direct schedule are made of (`plan_cores.core_spec`'s
``tree``, ``ring`` and ``hier``): the tree schedule's run on this rank (`tree`), the ring
schedule's (`ring`) and the hierarchical schedule's node steps (`hier`, whose rail runs the
direct schedule's pieces), each a dict of the plan's kept buffers and of what the core reads of
the schedule (``backend/csrc/plan_pieces.h``'s ``Tree``, ``Ring`` and ``Hier``)."""

from __future__ import annotations

from typing import Any

import torch

from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.codec import wire
from lowbitcc.schedules.chunking import stage


def tree(plan: Any) -> dict[str, Any]:
    """A tree schedule's run on this rank (`plan_cores.core_spec`'s ``tree``; `schedules.tree`): its
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


def ring(plan: Any, ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """A ring schedule's run on this rank (`plan_cores.core_spec`'s ``ring``; `schedules.ring`) over its
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


def hier(plan: Any) -> dict[str, Any]:
    """A hierarchical schedule's node steps on this rank (`plan_cores.core_spec`'s ``hier``;
    `schedules.hierarchical`, ``N`` nodes of ``L`` ranks, rows of ``m``): ``node``, the node
    link; ``nodes`` and ``node_size``; the call's ``numel``, ``dtype`` and ``factor`` (its op's
    input factor); ``values`` (fp32 ``[N L m]``: the source times the factor, zero past its
    end), ``send`` (fp32 ``[L, N m]``: its rows by local rank), ``received`` (uint8 ``[4 L N
    m]``: the node's all-to-all) and ``partial`` (fp32 ``[N m]``: their sum in local rank order,
    which the rail encodes and an all-reduce's rail decodes into); an all-reduce's ``gathered``
    (uint8 ``[4 L N m]``: the node's all-gather of its ranks' rails) and ``everything`` (fp32
    ``[N L m]``: the sums in row order, where the call's tensor is not that long). The core's
    own buffers; and ``deferred_errors``, what the Python plan's decodes of the rail raise once
    they are all done (`compressor.CallCompressor.raise_deferred`'s: NaN left where a message
    was refused, and nothing else amiss)."""
    lay, kept, device, m = plan.links.layout, plan.kept_buffers, plan.device, plan.m
    size = lay.nodes * lay.node_size * m

    def fp32(name: str, numel: int) -> torch.Tensor:
        return kept.get(f"core hier {name}", numel, torch.float32, device)

    hier: dict[str, Any] = {
        "node": plan.links.node().inner.group, "nodes": lay.nodes, "node_size": lay.node_size,
        "numel": plan.numel, "dtype": plan.codec_dtype, "factor": plan._factor,
        "deferred_errors": (wire.WireFormatError, CollectiveMismatchError),
        "values": fp32("values", size), "send": fp32("send", size),
        "received": kept.get("core hier received", 4 * size, torch.uint8, device),
        "partial": fp32("partial", lay.nodes * m),
    }
    if plan.collective == "all_reduce":
        hier["gathered"] = kept.get("core hier gathered", 4 * size, torch.uint8, device)
        hier["everything"] = fp32("everything", size)
    return hier
