"""`StreamWords`: zeroed int64 accumulators kept per CUDA stream for the frame kernels
(`cuda.CudaKernels`), so that no call zero-fills its own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from lowbitcc.codec import launch_recording


class StreamWords:
    """Zeroed int64 accumulators kept per CUDA stream: `taken` lends at least ``words`` of the
    current stream's to the launches in its block, which must leave them zero again
    (`FRAME_FOLD` does), so no call zero-fills its own. Work on one stream is ordered, and a
    lock keeps two host threads (two groups on one stream) from interleaving their launches;
    a block that raises drops the stream's buffer (it may be left dirty). A larger request
    replaces the buffer with a new zero-filled one (the old one goes back to the caching
    allocator, which reuses it on that stream only)."""

    def __init__(self) -> None:
        self._words: dict[tuple[str, int | None, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def taken(self, words: int, device: torch.device) -> Iterator[torch.Tensor]:
        launch_recording.refuse("a launch on a stream's words (which another call may replace)")
        stream = (torch.cuda.current_stream(device).cuda_stream if device.type == "cuda"
                  else 0)
        key = (device.type, device.index, stream)
        with self._lock:
            buf = self._words.get(key)
            if buf is None or buf.numel() < words:
                buf = self._words[key] = torch.zeros(max(words, 64), dtype=torch.int64,
                                                     device=device)
            try:
                yield buf[:words]
            except BaseException:
                self._words.pop(key, None)
                raise
