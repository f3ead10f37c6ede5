"""The state-valid ("poison") word of a device call's error states, on CPU tensors.

A call on a device does not know on the host whether it saw a non-finite value or a foreign
message, so `CallCompressor.finish` no longer zeroes its states with device kernels: each state
keeps the call's verdict as its ``poison`` word. The CUDA encode reads the word (a voided state
counts as zero; `tests/gpu/test_cuda_backend.py` checks that on a GPU); every other reader
settles the state first. Here the verdict is a CPU word standing in for the device's.
"""

from __future__ import annotations

import pytest
import torch

from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.kernels import select
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore


def _word(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64).view(torch.uint8)


def _state(dtype: str = "int8") -> ErrorState:
    return ErrorState.encode(torch.linspace(-1, 1, 128), dtype, 32)


@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("read", ["settle", "decode", "to", "clone"])
def test_every_reader_but_the_cuda_encode_honours_the_word(dtype, read):
    """`settle` (an encode that cannot read the word, on the call's stream) zeroes the state
    where the word is set and drops it; the other readers mask what they return and leave the
    stored state and its word alone (a call may still be setting the word)."""
    for verdict, voided in [(0, False), (1 << 8, True)]:  # the non-finite byte of the verdict
        state = _state(dtype)
        before = state.decode().clone()
        word = _word(verdict)
        state.poison = word
        if read == "settle":
            state.settle()
            values = state.decode()
            assert state.poison is None
        else:
            if read == "decode":
                values = state.decode()
            else:
                copy = state.to("cpu", copy=True) if read == "to" else state.clone()
                assert copy.poison is None
                values = copy.decode()
            assert state.poison is word
            state.poison = None
            assert torch.equal(state.decode(), before)  # the stored values untouched
        assert torch.equal(values, torch.zeros(128) if voided else before)


def test_a_feedback_store_checkpoint_settles_its_states():
    store = FeedbackStore()
    state = _state()
    state.poison = _word(1)  # the foreign byte
    store.put("k", state, 3, False)
    saved = store.state_dict()["states"]["k"]
    assert saved["uses"] == 3
    assert not saved["data"].any() and not saved["scales"].any()


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_an_encode_that_cannot_read_the_word_settles_the_state_first(impl):
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=2, signature=5,
                       kernels=select(impl), fmt="mxfp4")
    assert not codec.kernels.reads_poison
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    fresh = codec.encode(x, 2, 128, 1.0, None, 0.8, [0, 1], "int8")
    voided = ErrorState.encode(torch.full((256,), 0.25), "int8", 32)
    voided.poison = _word(1 << 8)
    got = codec.encode(x, 2, 128, 1.0, voided, 0.8, [0, 1], "int8")
    assert torch.equal(got.messages, fresh.messages)
    assert torch.equal(got.error.data, fresh.error.data)
    kept = ErrorState.encode(torch.full((256,), 0.25), "int8", 32)
    kept.poison = _word(0)
    assert not torch.equal(codec.encode(x, 2, 128, 1.0, kept, 0.8, [0, 1], "int8").messages,
                           fresh.messages)


def test_finish_leaves_a_device_call_s_verdict_on_its_states_and_queues_no_work():
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=2, signature=5,
                       kernels=select("reference"), fmt="mxfp4")
    store = FeedbackStore()
    comp = CallCompressor(codec, store, "bucket", Stats(), error_dtype="int8", beta=0.8,
                          reset_interval=8)
    state = _state()
    verdict = _word(0)
    comp._verdict = verdict  # what a call on a device holds
    comp._new_states["bucket|gather"] = (state, 1)
    comp.finish()
    kept, uses = store.take("bucket|gather", 128, "int8", 8, torch.device("cpu"), 32)
    assert kept is state and uses == 1 and kept.poison is verdict
    # a host-known non-finite call drops its states, as before
    comp.nonfinite = True
    comp._new_states["bucket|gather"] = (_state(), 2)
    comp.finish()
    assert store.take("bucket|gather", 128, "int8", 8, torch.device("cpu"), 32) == (None, 0)


def test_the_reference_encode_clears_the_verdict_it_is_given():
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=2, signature=5,
                       kernels=select("reference"), fmt="mxfp4")
    verdict = _word(0x0101)  # a fresh verdict's bytes are whatever the memory held
    codec.encode(torch.randn(256), 2, 128, 1.0, None, 0.8, [0, 1], "int8", verdict=verdict,
                 clear_verdict=True)
    assert not verdict.any()


class _Verdict:
    """A run's verdict on the states it stored (`ErrorState.run_verdict`), already given."""

    def __init__(self, dropped: bool) -> None:
        self._dropped = dropped

    def dropped(self) -> bool:
        return self._dropped


def test_a_state_its_run_dropped_counts_nowhere_and_is_dropped_at_its_next_take():
    """A plan's C++ core stores a CPU call's states before the call's last decodes, each with
    the run's verdict (`ErrorState.run_verdict`), dropped where a decode then met a non-finite
    value or a foreign message: such a state counts nowhere (length, keys, uses, checkpoints,
    ``max_keys``) and the store's next `take` drops it, as the Python path's `put` drops it; a
    verdict that keeps the state is let go of."""
    store = FeedbackStore(max_keys=2)
    void, kept, other = _state(), _state(), _state()
    void.run_verdict, kept.run_verdict = _Verdict(True), _Verdict(False)
    store.put("void", void, 3, False)
    store.put("kept", kept, 3, False)
    assert len(store) == 1 and store.keys() == ["kept"] and store.uses("void") == 0
    assert set(store.state_dict()["states"]) == {"kept"}
    void.run_verdict = _Verdict(True)
    store.put("void", void, 3, False)
    store.put("other", other, 1, False)  # a third key: the void one goes, not the oldest
    assert store.keys() == ["kept", "other"]
    store.put("void", void, 3, False)
    assert store.take("void", 128, "int8", 8, torch.device("cpu"), 32) == (None, 0)
    state, uses = store.take("kept", 128, "int8", 8, torch.device("cpu"), 32)
    assert state is kept and uses == 3 and state.run_verdict is None
