"""`lowbitcc perf`'s printed table (rank 0): nccl-tests' layout, a progress bar beside it, and
the table's parser (`parse_table`, for tests and tools that read the plain output)."""

from __future__ import annotations

import math
import os
import socket
import sys
from typing import Any

import torch


class _NoBar:
    def update(self, k: int) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)


def progress_bar(total: int, enabled: bool) -> Any:
    """A progress bar of ``total`` runs on stderr where it is a terminal and ``enabled``; else
    one that only prints the table's lines."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="run", leave=False, file=sys.stderr)


_COLS = [("size", 12, "(B)"), ("count", 12, "(elements)"), ("type", 9, ""), ("redop", 6, ""),
         ("root", 5, ""), ("backend", 10, "")]
_PLACE_COLS = [("time", 10, "(us)"), ("algbw", 7, "(GB/s)"), ("busbw", 7, "(GB/s)"),
               ("error", 9, "")]
_TAIL_COLS = [("wire", 12, "(B)"), ("ratio", 6, ""), ("host", 8, "(us)"), ("across", 12, "(B)")]


class TablePrinter:
    """Prints nccl-tests' table: '#'-prefixed header and footer, one line per size and backend.

    ``error`` replaces nccl-tests' ``#wrong``: the relative L2 error against the exact result
    (``0`` when bitwise exact, ``N/A`` with ``-c 0``); ``wire``/``ratio``/``host``/``across``
    are appended (``host``: ``N/A`` for backends that do not count their codec and wire time;
    ``across``: the bytes this rank sent to other nodes, ``N/A`` where the backend does not
    split its bytes by link, as for gloo's own calls).
    """

    def __init__(self, opts: Any, nranks: int, device: torch.device) -> None:
        """``opts``: the sweep's `harness.PerfOptions` (its header names them)."""
        self.opts = opts
        self.nranks = nranks
        self.device = device  # this rank's buffers' (`harness.device_of`)

    def header(self, names: list[str]) -> None:
        o = self.opts
        step = f"{o.step_bytes}(bytes)" if o.step_bytes else f"{o.factor}(factor)"
        lines = [
            f"# lowbitcc perf {o.collective}: nranks {self.nranks} minBytes {o.min_bytes} "
            f"maxBytes {o.max_bytes} step: {step} warmup iters: {o.warmup} iters: {o.iters} "
            f"rounds: {o.rounds} "
            f"validation: {o.check} backends: {' '.join(names)} schedule: {' '.join(o.schedules)}",
            "#",
            "# Using devices",
            f"#  Rank {0:2d} Pid {os.getpid():6d} on {socket.gethostname():>10} device "
            f"{_device_text(self.device)} threads {torch.get_num_threads()}",
            "#",
        ]
        lead = sum(w + 1 for _, w, _ in _COLS)
        span = sum(w + 1 for _, w, _ in _PLACE_COLS)
        lines.append("#" + " " * (lead - 1) + "out-of-place".center(span) + "in-place".center(span))
        for i in (0, 2):
            cells = [f"{c[i]:>{c[1]}}" for c in _COLS + _PLACE_COLS + _PLACE_COLS + _TAIL_COLS]
            lines.append("#" + " ".join(cells)[1:])
        for line in lines:
            print(line, flush=True)

    def row(self, row: dict[str, Any], bar: Any) -> None:
        cells = [f"{row['size']:>12d}", f"{row['count']:>12d}", f"{row['type']:>9}",
                 f"{row['redop']:>6}", f"{row['root']:>5d}", f"{row['backend']:>10}"]
        for place in ("out_of_place", "in_place"):
            r = row[place]
            cells += [f"{r['time_us']:>10.1f}", f"{r['algbw']:>7.3f}", f"{r['busbw']:>7.3f}",
                      f"{_error_text(r['error']):>9}"]
        host = row["host_us"]
        across = row["inter_node_bytes"]
        cells += [f"{row['wire_bytes']:>12d}", f"{row['ratio']:>6.3f}",
                  f"{'N/A' if host is None else format(host, '.1f'):>8}",
                  f"{'N/A' if across is None else across:>12}"]
        bar.write(" ".join(cells))

    def footer(self, result: dict[str, Any]) -> None:
        for name, bw in result["avg_busbw"].items():
            print(f"# Avg bus bandwidth    : {bw:.6g} {name}")
        exact = result["exact_backends"]
        rows = result["rows"]
        if exact and rows:
            largest = max(r["size"] for r in rows)
            at = {r["backend"]: r["out_of_place"]["busbw"] for r in rows if r["size"] == largest}
            base = at.get(exact[0])
            if base:
                ratios = ", ".join(f"{b} {v / base:.2f}x" for b, v in at.items() if b != exact[0])
                print(f"# busbw vs {exact[0]} at {largest} B: {ratios}")
        print("#", flush=True)


def _device_text(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device.index} [{torch.cuda.get_device_name(device)}]"
    return "cpu"


def _error_text(error: float) -> str:
    if math.isnan(error):
        return "N/A"
    return "0" if error == 0 else f"{error:.2e}"


def parse_table(text: str) -> list[dict[str, Any]]:
    """Rows of a printed table, as dicts keyed by column (out-of-place then in-place columns
    are prefixed ``oop_`` and ``ip_``); for tests and for tools that read the plain output."""
    names = [c[0] for c in _COLS] + [f"oop_{c[0]}" for c in _PLACE_COLS] + [
        f"ip_{c[0]}" for c in _PLACE_COLS] + [c[0] for c in _TAIL_COLS]
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != len(names):
            continue
        row: dict[str, Any] = {}
        for name, value in zip(names, fields, strict=True):
            try:
                row[name] = float(value) if name not in ("type", "redop", "backend") else value
            except ValueError:
                row[name] = math.nan if value == "N/A" else value
        rows.append(row)
    return rows
