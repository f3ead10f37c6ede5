"""`DataMovementMethods`: the c10d methods of a "loco" group's exact data movements (broadcast, the
all-gathers, gather, scatter, all-to-all, the barriers) and point to point, each handing its call
to the group's `data_movement.DataMovements` (``self._moves``), whose docstring says how each
runs. `process_group.LocoProcessGroup` inherits them, before ``dist.ProcessGroup`` (so c10d's
C++ callers reach them through pybind's trampoline, as its own methods); like its own, they run
outside torch.compile's frame evaluation (`eager.eager_methods`)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc.backend.eager import eager_methods
from lowbitcc.backend.works import LocoWork


@eager_methods
class DataMovementMethods:
    """The data movements' and point to point's c10d methods (see the module docstring); the
    class that inherits them sets ``_moves`` (its `DataMovements`) and ``config`` (its
    `LocoConfig`: ``param_bits``)."""

    _moves: Any
    config: Any

    # -- c10d methods: exact data movement (`DataMovements`) ----------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._moves.broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._moves.allgather(output_tensors, input_tensors, opts or AllgatherOptions())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> LocoWork:
        return self._moves.all_gather_single(output, input, opts, self.config.param_bits)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> LocoWork:
        return self._moves.all_gather_coalesced(outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._moves.exact("allgather_coalesced", output_lists, output_lists, input_list,
                                 opts or AllgatherOptions(), check=("all_gather", input_list, 0))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> LocoWork:
        return self._moves.gather(output_tensors, input_tensors, opts or dist.GatherOptions())

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> LocoWork:
        return self._moves.scatter(output_tensors, input_tensors, opts or dist.ScatterOptions())

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> LocoWork:
        # sizes may differ between ranks (uneven splits): the descriptor names none
        return self._moves.exact("alltoall", output_tensors, output_tensors, input_tensors,
                                 opts or dist.AllToAllOptions(), check=("all_to_all", [], 0))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> LocoWork:
        return self._moves.exact("alltoall_base", [output], output, input, output_split_sizes,
                                 input_split_sizes, opts or dist.AllToAllOptions(),
                                 check=("all_to_all", [], 0))

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> LocoWork:
        return self._moves.barrier(opts or dist.BarrierOptions())

    def monitored_barrier(self, timeout: datetime.timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's debugging barrier (`DataMovements.monitored_barrier`)."""
        self._moves.monitored_barrier(timeout, wait_all_ranks)

    # -- point to point: issued in order, never waited on by the worker ----------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LocoWork:
        return self._moves.exact("send", tensors, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LocoWork:
        return self._moves.exact("recv", tensors, tensors, src, tag, source_rank=lambda _: src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LocoWork:
        """Receive from whichever rank sends first; the Work's ``_source_rank()`` names it."""
        return self._moves.recv_anysource(tensors, tag)
