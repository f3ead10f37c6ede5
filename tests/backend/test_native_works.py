"""A place's exact entry returns the C++ `FollowedWork` (`lowbitcc.backend.native`,
`works.native_followed`) where it is built, else the Python one (`works.FollowedWork`). Each
call taking one of them at random, per rank and call (the ranks' choices differ; half the calls
are served by the C++ runner, `steady_runner`, and return its C++ Work): DDP's buckets
(whose reducer asks the C++ future) and calls whose Python callbacks issue calls (whose tags
name their parents in the descriptors) give gloo's results bit for bit and raise nothing; and
both kinds of Work wait, report completion and hand over their outputs alike."""

from __future__ import annotations

import collections
import random

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import native
from tests.support.ranks import run_ranks
from tests.support.training import bucketed_ddp, flat_parameters

pytestmark = pytest.mark.skipif(native.load() is None, reason="the C++ Works cannot be built here")


def _mixed(rank, world, gloo, seed, issuer):
    from lowbitcc.backend import issue_queue, works

    rng = random.Random(1000 * seed + rank)
    taken: collections.Counter = collections.Counter()
    follow = issue_queue.IssueQueue.follow

    def at_random(self, work, outputs):
        if rng.random() < 0.5:
            taken["python"] += 1
            return works.FollowedWork(self, self._next_tag(), work, outputs)
        taken["native"] += 1
        return follow(self, work, outputs)

    issue_queue.IssueQueue.follow = at_random
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(issuer=issuer))
    group._runner.decline_at_random(0.5, 1000 * seed + rank)  # the Python path's calls follow
    results = {}
    for name, pg in (("loco", group), ("gloo", gloo)):
        model, opt = bucketed_ddp(pg)
        gen = torch.Generator().manual_seed(rank)
        seen = []
        for _ in range(12):
            x = torch.randn(16, 64, generator=gen)
            with lowbitcc.exact():  # every bucket call its place's exact entry
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                # a Python callback on an exact entry's future issues a call of its own
                a = torch.randn(4096, generator=gen)
                b = torch.full((2048,), float(rank + 1))
                work = dist.all_reduce(a, group=pg, async_op=True)
                chained = work.get_future().then(
                    lambda fut, b=b, pg=pg: dist.all_reduce(b, group=pg) or fut.value()[0] + b[0])
                seen.append(chained.wait())
                assert work.wait() and work.is_completed() and work.exception() is None
        results[name] = (flat_parameters(model),
                         torch.stack(seen))
    taken["runner"] = group._runner.served
    return results, dict(taken)


@pytest.mark.parametrize("issuer", ["auto", "inline"])
def test_the_cpp_and_python_followed_works_mixed_at_random_give_gloo_s_results(issuer):
    for (results, taken), seed in zip(run_ranks(_mixed, 2, 7, issuer, timeout=240), (7, 7)):
        assert taken["python"] > 2 and taken["native"] > 2 and taken["runner"] > 5, (seed, taken)
        (params, seen), (want_params, want_seen) = results["loco"], results["gloo"]
        assert torch.equal(params, want_params)
        assert torch.equal(seen, want_seen)
