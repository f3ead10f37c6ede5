"""What `lowbitcc perf` writes besides its table (rank 0): the JSON result and the plot."""

from __future__ import annotations

import json
import logging
from typing import Any

from lowbitcc.tools.plotting import pyplot

log = logging.getLogger("lowbitcc.tools.perf")


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, allow_nan=True)
    log.info("wrote %s", path)


def plot(results: list[dict[str, Any]], path: str, title: str = "") -> None:
    """busbw against size, one line per backend (and per result, e.g. per link), log-log."""
    plt = pyplot("lowbitcc perf --plot", required=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        label = result.get("label", "")
        for name in result["backends"]:
            rows = [r for r in result["rows"] if r["backend"] == name]
            ax.plot([r["size"] for r in rows], [r["out_of_place"]["busbw"] for r in rows],
                    marker="o", ms=3, label=f"{name} {label}".strip())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s, logical bytes)")
    ax.set_title(title or f"{results[0]['collective']}, {results[0]['nranks']} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log.info("wrote %s", path)
