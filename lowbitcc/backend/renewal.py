"""`PlaceRenewal`: a call place's next agreement, made half a cycle ahead, in the background.

Under the call schedule (`call_schedule`) a place's entry runs ``REAGREE_EVERY`` times without
an exchange; then the ranks agree on the place's call again, with rank 0's cost-model suggestion
(`lowbitcc.cost_model`): compressing may no longer pay, or the model explores the other path.
That agreement does not need the call of the run it decides: a run's call is compared with its
place's entry at every run anyway (`deviation`: a rank whose call differs deviates, and every
rank sees it), so the ranks agree on the entry's own call instead. The run that leaves the
entry `call_schedule.renew_ahead` runs (32) starts it (`CallSchedule.ran`), as a descriptor
exchange on the group's worker; the place's run after the entry's last, 32 runs of the place
later, takes its outcome (`CallSchedule.entry`). The calling thread does not wait for that
exchange (a gloo all-gather of a few hundred bytes: 0.4-0.7 ms here, up to 5 ms; once every 64
runs it stalled the call), unless the worker is that far behind, or the place has just run one
exploration (whose run starts the next renewal, taken at the place's next run).

Every rank starts the same renewals at the same runs, in issue order on its worker, and reads
the same gathered descriptors, so every rank takes the same outcome at the same run (`outcome`,
computed as `compressed_call.CompressedCall.run` computes an exchange's): the entry again for
another ``REAGREE_EVERY`` runs, the other path where rank 0's model chose it (or where a rank's
policy no longer wants compression), or one run of the other path, an exploration; an exact
run rank 0's model chose is timed for the model once per agreement (`Entry.timed`), as at an
exchange. What a renewal's descriptor says: this rank's descriptor of the agreed call, with its
suggestion and its wish under the policy in force at the run that starts it, and its deviation
since its last exchange (`wire.DESC_DEVIATED`, `CallSchedule.take_deviated`), so that the
other ranks learn of a deviation at an exact place without a canary (a reduce-scatter's): every
rank raises `call_agreement.DeviatedPeerError` where it takes the renewal (at most about one and
a half cycles of a place after the deviation), and starts its schedule again. A place whose
canary turns NaN takes its renewal before it exchanges, for the same reason. A call at whose
place a renewal raised takes its call numbers first, as the other ranks' calls do
(`reductions.Reductions`).

Not handled, as with an exchange whose frame arrives corrupt in every copy on one rank and
whose path the intact frames do not settle: that rank raises `call_agreement.CorruptFrameError`
where it takes the renewal, and the others, which took the outcome, run the place's call
without it (their call fails within the group's timeout).

Threads: made in the calling thread; the exchange runs on the worker; `outcome` is read by the
calling thread.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from lowbitcc import policy
from lowbitcc.backend.call_schedule import Entry, runs_for
from lowbitcc.codec import wire
from lowbitcc.cost_model import Suggestion

if TYPE_CHECKING:
    from lowbitcc.backend.compressed_call import CallGroup


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a renewal agreed on: the place's call ``exact`` (``by_model``: because rank 0's
    cost model chose it) or compressed, for ``left`` runs from the run that takes it on
    (``explore``: one run, an exploration of the other path, `cost_model`)."""

    exact: bool
    by_model: bool
    left: int
    explore: bool = False


class PlaceRenewal:
    """The renewal of ``entry``, a place's entry of ``device_type`` tensors in ``group``,
    started now (reporting this rank's deviation where ``deviated``): this rank's descriptor
    exchanged on the group's worker (``group.submit``) over its agreement, with its cost
    model's suggestion where the model chooses the call's path (`CallGroup.modelled`, not
    forced)."""

    def __init__(self, group: CallGroup, device_type: str, entry: Entry,
                 deviated: bool) -> None:
        desc, config = entry.desc, group.config
        nbytes = desc.numel * desc.dtype.itemsize
        self._desc, self._group, self.deviated = desc, group, deviated
        self._device_type, self._nbytes = device_type, nbytes
        self._suggestion: Suggestion | None = None
        if group.modelled(desc.numel) and not policy.forced():
            self._suggestion = group.cost_model.suggest(desc.collective, nbytes, device_type,
                                                        counts=False)
        wants = (config.policy != "never" and entry.eligible
                 and policy.wants_compression(config.policy))
        s = self._suggestion
        self._call = dataclasses.replace(
            desc, compressed=wants and desc.numel >= config.min_size, deviated=deviated,
            prefer_exact=s is not None and s.exact,
            explore=s is not None and s.explore)
        self._leader: wire.CallDescriptor | None = None
        assert group.submit is not None
        self._work = group.submit(self._exchange)

    def _exchange(self) -> list:
        """The worker's job: the descriptor exchange (`CallAgreement.agree`)."""
        self._leader = self._group.agreement.agree(self._call)
        return []

    def _schedulable(self) -> bool:
        """Whether a compressed run of the call has a schedule on its route; False where the
        configured schedule cannot run there (the place exchanges, and the call raises there
        as before)."""
        group, device_type = self._group, self._device_type
        try:
            group.schedule_for(self._nbytes, group.route(torch.device(device_type)),
                               device_type)
        except ValueError:
            return False
        return True

    def outcome(self) -> Outcome | None:
        """Wait for the exchange and return what every rank takes (None: the place has no
        entry, and its run exchanges; raises what the exchange raised)."""
        self._work.wait()
        leader, s = self._leader, self._suggestion
        assert leader is not None
        if not leader.compressed:  # some rank would not compress it
            exact, by_model, explore = True, False, False
        elif s is not None and leader.prefer_exact:
            exact, by_model, explore = True, True, leader.explore
        else:
            exact, by_model, explore = False, False, s is not None and leader.explore
        runs = runs_for(dataclasses.replace(self._desc, explore=False), not exact,
                        not exact and self._schedulable(), self._group.size)
        if runs == 0:
            return None
        return Outcome(exact, by_model, 1 if explore else runs + 1, explore)
