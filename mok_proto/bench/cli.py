"""What the benchmark scripts share on their command lines: a parser whose --help shows the
script's docstring and every option's default and whose errors are one line, the bars as
`--bar KEY=VALUE`, and the routing as `--routing SPEC` (mok_proto.routing)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from mok_proto.routing import UNIFORM, RoutingSpec


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and "(default: ...)" after every option that has one."""

    def _get_help_string(self, action):
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default in ([], ()):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit 2), without the usage, and whose
    options without a help text still show their default in --help."""

    def add_argument(self, *args, **kwargs):
        if kwargs.get("help") is None and kwargs.get("default") is not None:
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's argument parser; its --help prints `doc` (the script's docstring) first."""
    return Parser(description=doc, formatter_class=HelpFormatter)


@dataclass(frozen=True)
class Bar:
    """A value a benchmark's figure must reach: at least `value` (at_most: at most), `what` says of which."""

    value: float
    what: str
    at_most: bool = False

    def met(self, measured) -> bool:
        """Whether `measured` meets the bar (None or NaN: not measured, so not met)."""
        if measured is None or math.isnan(measured):
            return False
        return measured <= self.value if self.at_most else measured >= self.value

    def __str__(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.value:g}"


def add_bar_option(p: argparse.ArgumentParser, bars: dict, note: str = "") -> None:
    """--bar KEY=VALUE (repeatable, or comma-separated) over `bars` {key: Bar}, every bar and its
    default in the help, then `note` (e.g. another bar set's defaults)."""
    listed = "; ".join(f"{key}={bar.value:g} ({'at most' if bar.at_most else 'at least'}: {bar.what})"
                       for key, bar in bars.items())
    p.add_argument("--bar", action="append", default=[], metavar="KEY=VALUE",
                   help="set a bar of this benchmark (repeatable, or KEY=VALUE,KEY=VALUE). Bars and defaults: "
                        + listed + (f". {note}" if note else ""))


def parse_bars(items, bars: dict, unjudged: dict | None = None) -> dict:
    """`bars` with the values of --bar's KEY=VALUE items in place of the defaults. ValueError (one
    line) for an unknown key, a key of `unjudged` ({key: why this run does not judge it}) or a value
    that is not a finite number."""
    out = dict(bars)
    for item in (part.strip() for text in items for part in text.split(",")):
        if not item:
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if key in (unjudged or {}):
            raise ValueError(f"--bar {key}: {unjudged[key]}")
        if not sep or key not in bars:
            raise ValueError(f"--bar: {item!r} is not KEY=VALUE with KEY one of {', '.join(bars)}")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"--bar {key}: {value!r} is not a finite number")
        out[key] = dataclasses.replace(bars[key], value=number)
    return out


def routing_spec(text: str) -> RoutingSpec:
    """--routing's type: the parsed spec, or argparse's one-line error naming the accepted forms."""
    try:
        return RoutingSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_routing_option(p: argparse.ArgumentParser, what: str) -> None:
    """--routing SPEC (default uniform) -> args.routing, a RoutingSpec; `what` says where it applies."""
    p.add_argument("--routing", type=routing_spec, default=UNIFORM, metavar="SPEC",
                   help="the routing: uniform, zipf:ALPHA (expert popularity 1/(j+1)^ALPHA, the hottest expert "
                        "the timed rank's) or hot:FRACTION (that fraction of all tokens' first choices on the timed "
                        f"rank's experts); {what}; recorded in every row as `routing` (mok_proto.routing)")
