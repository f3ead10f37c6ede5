"""What an exact call's output holds where another rank deviated from the place's entry, and
the error its Work raises on the ranks that did not: `CollectiveMismatchError`, the error of
calls that do not match across ranks (defined here, below the Works that raise it;
`call_agreement` raises it and its subclass `DeviatedPeerError` where descriptors differ).

A rank whose call is not its place's exact entry runs the entry's call on a buffer of NaN whose
first `PROBE` elements (of each rank's part, for a reduce-scatter) are -0.0
(`deviation.ExactDeviation`). The output of every rank that did not deviate is then NaN past
its first ``probe_of(numel)`` elements, which hold the other ranks' own sum. Where it has at
least ``2 * PROBE`` elements its Work (the exact entry's `works.FollowedWork`, or the C++ one,
which takes `PROBE` and `MESSAGE` from here through `works.native_followed`) reads that when the
call completes and raises `CollectiveMismatchError` from its ``wait`` and its future, so that no
rank returns the NaN output as a result; every rank raises again at the place's next exchange
(`call_agreement.DeviatedPeerError`), where the schedule starts again. Other outputs, NaN ones
too (a gradient that overflowed), complete as they are: an input would have to be NaN at every
element past exactly the first `PROBE` and at none before them to look alike.
"""

from __future__ import annotations

import torch


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (shape, dtype, op or order) on the same group."""


PROBE = 16
"""-0.0 elements per rank's part of a deviating rank's buffer (at most half of it)."""

MESSAGE = ("lowbitcc: another rank issued a call that is not the one the ranks had agreed on at "
           "this place in their sequence of calls: it contributed NaN to this exact call in "
           "place of its own, so this call's output is NaN past its first elements; every rank "
           "raises again at the place's next call that exchanges, and the ranks agree again")
"""What the Work of such a call raises."""


def probe_of(numel: int) -> int:
    """The probed elements of a part of ``numel`` elements (`PROBE`, at most half of it)."""
    return min(PROBE, numel // 2)


def deviated(output: torch.Tensor) -> bool:
    """Whether ``output`` (a completed exact call's, on the CPU) is what a deviating peer
    leaves: floating-point, of at least ``2 * PROBE`` elements (a smaller one, say a metric and
    a NaN loss, is not read: its ranks raise at the place's next exchange), NaN at its last
    element (read first: almost never), at every element past its first `PROBE`, and at none
    of those."""
    n = output.numel()
    probe = PROBE
    if n < 2 * probe or not output.is_floating_point() or output.device.type != "cpu":
        return False
    flat = output.reshape(-1)
    if not bool(torch.isnan(flat[-1])):
        return False
    return bool(torch.isnan(flat[probe:]).all()) and not bool(torch.isnan(flat[:probe]).any())


def checked(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` of a completed exact entry's call, or raise `CollectiveMismatchError`
    (`MESSAGE`) where the first is `deviated`."""
    if outputs and deviated(outputs[0]):
        raise CollectiveMismatchError(MESSAGE)
    return outputs
