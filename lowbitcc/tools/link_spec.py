"""What an emulated link is: `Link` (rate, one-way delay, jitter, loss), its parsers (tc's
units), the `PRESETS` of wide-area links, and the command-line flags that name one
(`add_arguments`, `from_arguments`), shared by ``lowbitcc netem``, ``perf`` and ``bench-train``."""

from __future__ import annotations

import argparse
import dataclasses
import re

from lowbitcc.tools.delay_switch import LinkModel

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us)\s*$", re.IGNORECASE)
_TIME_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_LOSS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_rate(text: str) -> int:
    """``"1gbit"``, ``"10Gbit"``, ``"500mbit"``, ``"1g"`` -> bits per second (tc's units:
    ``bit`` is bits per second, ``bps`` bytes per second)."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"lowbitcc netem: cannot parse link rate {text!r}; use e.g. 1gbit, 10gbit")
    value, scale, unit = match.groups()
    bits = float(value) * _SCALE[scale.lower()] * (8 if (unit or "").lower() == "bps" else 1)
    if bits < 1e5:
        raise ValueError(f"lowbitcc netem: link rate {text!r} is below 100 kbit/s")
    return int(bits)


def parse_time(text: str, what: str) -> float:
    """``"40ms"``, ``"1.5s"``, ``"500us"`` -> seconds (tc's time units; a unit is required)."""
    match = _TIME.match(text)
    if not match or float(match.group(1)) * _TIME_SCALE[match.group(2).lower()] > 10:
        raise ValueError(f"lowbitcc netem: cannot parse {what} {text!r}; use e.g. 40ms, 500us "
                         "(at most 10s)")
    return float(match.group(1)) * _TIME_SCALE[match.group(2).lower()]


def parse_loss(text: str) -> float:
    """``"0.1%"`` -> 0.001 (a percentage below 50%, as tc netem writes it)."""
    match = _LOSS.match(text)
    if not match or float(match.group(1)) >= 50:
        raise ValueError(f"lowbitcc netem: cannot parse loss {text!r}; use a percentage below "
                         "50%, e.g. 0.1%")
    return float(match.group(1)) / 100


@dataclasses.dataclass(frozen=True)
class Link:
    """Each node's link: ``rate`` (tc units; None: unshaped), one-way ``delay`` and ``jitter``
    (tc time units, e.g. ``"40ms"``; the jitter at most the delay) and random ``loss`` (e.g.
    ``"0.1%"``). With any of the last three it is a wide-area link (`wide_area`)."""

    rate: str | None = "1gbit"
    delay: str | None = None
    jitter: str | None = None
    loss: str | None = None

    def __post_init__(self) -> None:
        model = self.model()
        if model.jitter > model.delay:
            raise ValueError(f"lowbitcc netem: jitter {self.jitter} exceeds the delay "
                             f"{self.delay or '0ms'}")

    @classmethod
    def of(cls, link: Link | str | None) -> Link:
        """A `Link` as given, or one of rate ``link`` (a tc rate, or None: unshaped)."""
        return link if isinstance(link, Link) else cls(rate=link)

    @property
    def wide_area(self) -> bool:
        return any((self.delay, self.jitter, self.loss))

    def model(self) -> LinkModel:
        """The link in numbers (bits/s, seconds, probability) for `DelaySwitch`."""
        return LinkModel(rate=parse_rate(self.rate) if self.rate else None,
                         delay=parse_time(self.delay, "delay") if self.delay else 0.0,
                         jitter=parse_time(self.jitter, "jitter") if self.jitter else 0.0,
                         loss=parse_loss(self.loss) if self.loss else 0.0)

    def describe(self) -> str:
        """E.g. ``"100mbit, 40ms +-2ms one way, 0.01% loss"``."""
        parts = [self.rate or "unshaped"]
        if self.delay or self.jitter:
            parts.append(f"{self.delay or '0ms'}" + (f" +-{self.jitter}" if self.jitter else "")
                         + " one way")
        if self.loss:
            parts.append(f"{self.loss} loss")
        return ", ".join(parts)


PRESETS = {
    "same-region": Link("1gbit", "1ms", "100us"),
    "cross-continent": Link("100mbit", "40ms", "2ms", "0.01%"),
}
"""`lowbitcc netem --wan NAME`: links people meet between sites (docs/wan.md): two data centres
of one region (1 Gbit/s per node, 2 ms round trip), and two continents (100 Mbit/s per node,
80 ms round trip, rare loss)."""




def add_arguments(parser: argparse.ArgumentParser, default_rate: str | None = None) -> None:
    """``--link RATE``, ``--delay``, ``--jitter``, ``--loss`` and ``--wan PRESET`` (read them
    back with `from_arguments` and the same ``default_rate``)."""
    parser.add_argument("--link", help="emulate links of this rate (tc units, e.g. 1gbit, "
                        "100mbit, or none: unshaped" +
                        (f"; default {default_rate}" if default_rate else "") + "; root)")
    parser.add_argument("--delay", help="one-way delay of each link, e.g. 40ms (a wide-area link)")
    parser.add_argument("--jitter", help="uniform jitter of the delay, e.g. 2ms (at most --delay)")
    parser.add_argument("--loss", help="random packet loss, e.g. 0.1%%")
    parser.add_argument("--wan", choices=sorted(PRESETS),
                        help="a preset wide-area link: " + "; ".join(
                            f"{name}: {link.describe()}".replace("%", "%%")
                            for name, link in PRESETS.items()) +
                        " (--link, --delay, --jitter, --loss override its parts)")


def from_arguments(args: argparse.Namespace, default_rate: str | None = None) -> Link | None:
    """The link the flags of `add_arguments` name, or None where none is emulated (neither
    ``--link``, ``--wan`` nor a ``default_rate``). Raises `ValueError` naming a bad value."""
    preset = PRESETS[args.wan] if args.wan else None
    rate = args.link or (preset.rate if preset else default_rate)
    if preset is None and rate is None:
        if args.delay or args.jitter or args.loss:
            raise ValueError("lowbitcc: --delay, --jitter and --loss need --link RATE (or none) "
                             "or --wan")
        return None
    base = preset or Link(rate=None)
    return Link(rate=None if rate == "none" else rate,
                delay=base.delay if args.delay is None else args.delay,
                jitter=base.jitter if args.jitter is None else args.jitter,
                loss=base.loss if args.loss is None else args.loss)
