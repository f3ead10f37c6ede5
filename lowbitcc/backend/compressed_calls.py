"""`CompressedCalls`: what one "loco" group needs to build and run its compressed calls.

The group's process group asks it, in the issuing thread, whether a call must exchange a
descriptor (`agrees_on`, `checks_data_movement`) and for the call itself: `call` and
`all_gather` return a `compressed_call.CompressedCall` (the job). It holds what the calls of the
group share: the settings, the `Route` per device type, the call schedule per device type, the
descriptor exchanges (`call_agreement.CallAgreement`), the cost model, the feedback keys'
ordinals, the worker's decode buffer, and the CUDA calls' stream timings.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import policy, state
from lowbitcc.backend.call_agreement import (
    CallAgreement,
    CollectiveMismatchError,
    CorruptFrameError,
    InvalidPeerCallError,
)
from lowbitcc.backend.call_schedule import CallSchedule, Entry, Place, takes_place
from lowbitcc.backend.compressed_call import CALLS
from lowbitcc.backend.cuda_issue import StreamTimings
from lowbitcc.backend.issue_queue import Job
from lowbitcc.backend.place_graph import LiveGraphs
from lowbitcc.backend.renewal import PlaceRenewal
from lowbitcc.backend.routes import Route, choose_schedule
from lowbitcc.backend.works import InnerWork
from lowbitcc.buffers import Buffers
from lowbitcc.codec import wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor
from lowbitcc.config import LocoConfig
from lowbitcc.cost_model import CostModel, SizeClass
from lowbitcc.schedules.chunking import chunk_width
from lowbitcc.transports.gloo import GlooTransport

CODECS_KEPT = 1024
"""Codec templates kept per group (`CompressedCalls.codec`), the oldest dropped first."""


def _untimed() -> None:
    """The end of a timing that was not taken (`CompressedCalls.clock`)."""


class CompressedCalls:
    """The compressed calls of one group of ``size`` ranks (see the module docstring).

    ``agreement`` is the group's inner gloo transport (descriptor exchange, unmetered);
    ``routes`` maps a device type to its `Route`; ``submit(job)`` queues ``job`` on the group's
    worker thread and returns its Work (inline routes' exchanges, the places' renewals).
    `group_name` is set by c10d after creation.
    """

    def __init__(self, rank: int, size: int, config: LocoConfig, agreement: GlooTransport,
                 routes: dict[str, Route], submit: Callable[[Job], Any] | None = None,
                 timeout_s: float = 1800.0) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self.agreement = CallAgreement(rank, agreement)
        self.submit = submit
        self.cost_model = CostModel()
        self.scratch = Buffers()  # the worker thread's decode buffer
        self.graphs = LiveGraphs()  # the places' CUDA graphs (`place_graph`)
        self._routes = routes
        self._stream_timings = StreamTimings(model=self.cost_model)  # the issuing thread's
        scheduled = self.exchanges()
        self._modelling = config.cost_model and scheduled
        self.call_schedules: dict[str, CallSchedule] = {
            device: CallSchedule(timeout_s, None if submit is None else functools.partial(
                PlaceRenewal, self, device)) for device in routes if scheduled}
        self._codecs: dict[tuple, ShardCodec] = {}
        self._lock = threading.Lock()
        self._epoch: tuple[str, int] | None = None
        self._ordinals: dict[tuple, int] = {}

    @property
    def group_name(self) -> str:
        return self.agreement.group_name

    @group_name.setter
    def group_name(self, name: str) -> None:
        self.agreement.group_name = name

    def agrees_on(self, numels: list[int]) -> bool:
        """Whether a reduction that this rank will not compress must still exchange descriptors
        (with ``wants=False``): another rank may be about to compress the same call, or to
        issue another one (a size, dtype or op mismatch then raises instead of hanging). Its
        calls have ``numels`` elements (the whole input of each). Every such call takes a
        place in the call schedule and exchanges until its place holds an entry (``check``, and
        a policy that may compress); issued by the worker, the small ones carry their input in
        the frame (`exchange_frame.FRAME_PAYLOAD`) and need no second exchange."""
        return bool(numels) and self.exchanges()

    def exchanges(self) -> bool:
        """Whether the group's reductions exchange descriptors at all: ``check``, a policy that
        may compress, and more than one rank (a group of one agrees with itself)."""
        cfg = self.config
        return cfg.check and cfg.policy != "never" and self.size > 1

    def checks_data_movement(self) -> bool:
        """Whether exact data movements of CPU tensors (broadcast, all-gather, gather, scatter,
        all-to-all, barrier, reduce) exchange a descriptor first (`checked`): under
        ``check_all`` with a policy that may compress (where CPU reductions exchange one too),
        so that a broadcast on one rank against an all-reduce on another raises instead of
        hanging (docs/reliability.md)."""
        return self.exchanges() and self.config.check_all

    def checked(self, collective: str, dtype: torch.dtype, numel: int, job: Job, *,
                op: int = 0, root: int = 0) -> Job:
        """`CallAgreement.checked`: ``job`` preceded by a descriptor exchange, `unplaced`."""
        return self.unplaced(self.agreement.checked(collective, dtype, numel, job, op=op,
                                                    root=root))

    def unplaced(self, job: Job) -> Job:
        """``job``, a call that exchanges a descriptor but takes no place (a data movement
        under ``check_all``, a ``param_bits`` all-gather), issued now. Issued where calls take
        places (`call_schedule.takes_place`), it opens every schedule until its exchange is
        done, so that the next reduction takes its place knowing the outcome, and where the
        exchange raised on every rank (another rank issued another call) it forgets every
        place (`forget_places`), as each rank does at this call: a call one rank issued as a
        reduction and another as a data movement took a place on one rank only."""
        schedules = list(self.call_schedules.values()) if takes_place("cpu") else []
        if not schedules:
            return job
        for schedule in schedules:
            schedule.open()

        def run() -> Any:
            try:
                return job()
            except (CollectiveMismatchError, InvalidPeerCallError):
                self.forget_places()
                raise
            finally:
                for schedule in schedules:
                    schedule.settle()

        return run

    def forget_places(self) -> None:
        """Every rank raised at one exchange because the ranks' calls differed: forget every
        place, on every schedule (`CallSchedule.forget`), the next call being index 0 on every
        rank whatever places the differing calls took."""
        for schedule in self.call_schedules.values():
            schedule.forget()

    def refused(self, collective: str, error: Exception, numels: list[int],
                like: torch.Tensor | None, plan: Place | None = None) -> Job:
        """The job of a call whose arguments this rank found invalid (``error``), where a
        valid call would exchange a descriptor: it exchanges one flagged `wire.DESC_INVALID`,
        so that every other rank raises `InvalidPeerCallError` for the same call instead of
        pairing its exchange with this rank's next call, then raises ``error``. ``numels``:
        the whole input of each call (tensor) the valid call would be, as this rank's outputs
        say: it takes as many sequence numbers. Data movements pass ``[0]`` and None (one
        call). ``plan``: the first call's place, an exchange (under the call schedule)."""
        seqs = [self.agreement.next_seq() for _ in numels]
        desc = wire.CallDescriptor(collective=collective, dtype=torch.float32, op=0, numel=0,
                                   seq=seqs[0], bits=0, group_size=0, compressed=False,
                                   invalid=True,
                                   deviated=plan is not None and plan.schedule.take_deviated())

        def run() -> Any:
            # this rank's own error says more than any the exchange raises
            with contextlib.suppress(CorruptFrameError, InvalidPeerCallError,
                                     CollectiveMismatchError):
                self.agreement.agree(desc)
            if plan is not None:  # the others raise here too, and forget theirs
                self.forget_places()
            raise error

        return run

    def route(self, device: torch.device) -> Route:
        try:
            return self._routes[device.type]
        except KeyError:
            raise ValueError(
                f"lowbitcc: compressed calls on {device.type} tensors are not served by this "
                f"group (served: {', '.join(self._routes)})"
            ) from None

    # -- in the issuing thread ---------------------------------------------------------------
    def key(self, collective: str, tensor: torch.Tensor, numel: int) -> tuple[str, bool]:
        """The error-feedback key of this call (counts it within the current epoch), and
        whether it was derived from the call's position (False: named by `feedback_key`)."""
        explicit = policy.explicit_key()
        if explicit is not None:
            return f"{self.key_prefix()}{explicit}", False
        ordinal = self._ordinal(collective, tensor.dtype, numel)
        return f"{self.key_prefix(collective, tensor.dtype, numel)}{ordinal}", True

    def key_prefix(self, collective: str | None = None, dtype: torch.dtype | None = None,
                   numel: int = 0) -> str:
        """A key (`key`) up to what follows it: without a ``collective``, a named key's, which
        the name follows; else a derived key's of a call of ``collective`` on ``numel``
        elements of ``dtype``, which its ordinal follows. The one definition of the keys' form,
        which a plan's C++ core completes too (`plan_cores`)."""
        if collective is None:
            return f"{self.group_name}|"
        name = str(dtype).replace("torch.", "")
        return f"{self.group_name}|{collective}|{name}|{numel}|"

    def _ordinal(self, collective: str, dtype: torch.dtype, numel: int) -> int:
        """The position of this call among the calls of its signature in the current epoch
        (`policy.epoch`), counted."""
        epoch = policy.epoch()
        signature = (collective, dtype, numel)
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._ordinals.clear()
            ordinal = self._ordinals.get(signature, 0)
            self._ordinals[signature] = ordinal + 1
        return ordinal

    def wants(self, op: Any, outputs: list[torch.Tensor]) -> bool:
        """Whether this rank would compress a reduction by ``op`` (a ``RedOpType``) into
        ``outputs``, issued now (the policy, and the op and dtypes: `policy.eligible`)."""
        cfg = self.config
        return (cfg.policy != "never" and all(policy.eligible(t, op) for t in outputs)
                and policy.wants_compression(cfg.policy))

    def count_planned(self, collective: str, like: torch.Tensor, numel: int,
                      entry: Entry) -> SizeClass | None:
        """Count a call that runs as its place's exact ``entry`` as its job would count it:
        its call number (the ranks' numbers stay in step), its feedback key's ordinal where
        this rank would compress it (`wants`: the entry's call eligible, `Entry.eligible`, and
        the policy in force), the cost model's count; its size class where the cost model
        times it, else None (the caller counts it in the statistics, ``model_exact`` where the
        model chose the entry and times it: `exact.count_exact`)."""
        self.agreement.next_seq()
        mode = self.config.policy
        if (entry.eligible and mode != "never" and policy.wants_compression(mode)
                and policy.explicit_key() is None):  # counted as `key` counts it
            self._ordinal(collective, like.dtype, numel)
        if not self.modelled(numel) or policy.forced():
            return None
        size_class = CostModel.size_class(collective, numel * like.element_size(),
                                          like.device.type)
        self.cost_model.count(size_class)
        return size_class

    def compressor(self, codec: ShardCodec, key: str = "", buffer: StorageWeakRef | None = None,
                   scratch: Buffers | None = None) -> CallCompressor:
        """A `CallCompressor` of ``codec`` under the group's feedback settings (``key``,
        ``buffer``, ``scratch``: `CallCompressor`'s)."""
        cfg = self.config
        return CallCompressor(
            codec, state.FEEDBACK, key, state.STATS,
            error_dtype=cfg.error_dtype if cfg.wire_feedback else None, beta=cfg.beta,
            reset_interval=cfg.reset_interval, rank=self.rank, scratch=scratch, buffer=buffer)

    def codec(self, collective: str, dtype: torch.dtype, numel: int, device_type: str,
              route: Route) -> ShardCodec:
        """The `ShardCodec` of compressed calls of ``collective`` on ``numel`` elements of
        ``dtype`` on ``device_type`` tensors (built once per such shape; `ShardCodec.with_seq`
        gives a call's own)."""
        shape = (collective, dtype, numel, device_type)
        codec = self._codecs.get(shape)
        if codec is None:
            cfg = self.config
            codec = ShardCodec(
                bits=cfg.bits, group_size=cfg.wire_group_size,
                dtype_code=wire.DTYPE_CODES[dtype], seq=0, world=self.size,
                signature=wire.call_signature(collective, numel, dtype),
                kernels=route.kernels, rounding=cfg.rounding, seed=cfg.seed,
                checksum=cfg.checksum_for(device_type), fmt=cfg.wire_format)
            with self._lock:  # the worker and the issuing threads both build calls
                self._codecs[shape] = codec
                if len(self._codecs) > CODECS_KEPT:
                    self._codecs.pop(next(iter(self._codecs)))
        return codec

    def modelled(self, numel: int) -> bool:
        """Whether the cost model may choose the path of a reduction of ``numel`` elements
        (with the policy's consent: not under `lowbitcc.compressed`, which forces it)."""
        return self._modelling and numel >= self.config.min_size

    def call(self, collective: str, output: torch.Tensor, source: torch.Tensor, op: Any,
             exact: Job, wants: bool = True, plan: Place | None = None,
             part: bool = False) -> Job:
        """The job of a compressed ``collective`` (`compressed_call.CALLS`) of flat or in-place
        ``source`` into ``output`` (``exact``: the fallback after an exchange; ``wants``:
        whether this rank would compress it, see `agrees_on`; ``plan``: its place (`plan`);
        ``part``: one tensor of several)."""
        try:
            return CALLS[collective](self, output, source, op, exact, wants, plan, part)
        except BaseException:
            if plan is not None:
                plan.settle()
            raise

    def clock(self, size_class: SizeClass, exact: bool, nbytes: int) -> Callable[[], None]:
        """Start timing a call of ``size_class`` on one path; the returned function ends it,
        and its time goes to the cost model: wall time for CPU calls (on the worker, or on the
        calling thread under ``LOCO_ISSUER=inline``), GPU time on the current stream for CUDA
        calls, reported once the GPU has passed it (none while a graph is captured: no event
        is recorded inside a capture)."""
        if size_class[1] != "cpu":
            if torch.cuda.is_current_stream_capturing():
                return _untimed
            timings = self._stream_timings
            begun = timings.start()
            return lambda: timings.stop(begun, size_class, exact, nbytes)
        start = time.perf_counter()
        return lambda: self.cost_model.record(size_class, exact, time.perf_counter() - start,
                                              nbytes)

    def timed_exact(self, exact: Job, size_class: SizeClass, nbytes: int) -> Any:
        """Start ``exact``; its time, until the inner work completes, goes to the cost model."""
        stop = self.clock(size_class, True, nbytes)
        result = exact()
        if not isinstance(result, InnerWork):
            stop()
            return result
        finish = result.finish

        def timed_finish() -> list[torch.Tensor]:
            stop()
            return finish()

        return InnerWork(result.work, timed_finish)

    def chunk(self, route: Route, m: int) -> int:
        """The chunk width for rows of ``m`` elements: ``chunk_size``, widened to a
        ``max_chunks``-th of the row where that is wider (0 for ``route.inline``: no chunks)."""
        if route.inline:
            return 0
        return chunk_width(m, self.config.chunk_size, self.config.max_chunks)

    def schedule_for(self, nbytes: int, route: Route, device_type: str) -> str:
        """The compressed schedule of a call of ``nbytes`` input bytes on ``route``'s
        ``device_type`` tensors."""
        name = choose_schedule(self.config, nbytes, self.size, route.links.layout)
        if route.schedules is None or name in route.schedules:
            return name
        if self.config.schedule == "auto":
            return route.schedules[0]
        raise ValueError(
            f"lowbitcc: LOCO_SCHEDULE={name} cannot run on {device_type} tensors; "
            f"their transport runs {', '.join(route.schedules)} (or auto)")
