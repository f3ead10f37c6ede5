"""`lowbitcc codec-bench` on CPU: one small size, every format, reference and C++ rows."""

from __future__ import annotations

import json

from lowbitcc.codec import cpu
from lowbitcc.tools import codec_bench


def test_codec_bench_measures_every_format_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    rows = codec_bench.run(min_size=64 << 10, max_size=64 << 10, threads=[1], min_time=0.01,
                           json_path=str(path))
    impls = ["reference"] + (["cpu"] if cpu.load() is not None else [])
    assert [(r["format"], r["impl"]) for r in rows] == [(f, i) for f in ("mxfp4", "int") for i in impls]
    assert {r["group"] for r in rows} == {32, 128}  # each format's default group
    assert all(r["encode_GBps"] > 0 and r["decode_GBps"] > 0 for r in rows)
    assert json.loads(path.read_text())["rows"] == rows
