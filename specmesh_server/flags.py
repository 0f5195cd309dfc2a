"""Every service's flags: each defaults to the ``SPECMESH_*`` variable named after it, ``--help``
shows the default and the variable, and a bad value (flag or variable) is a one-line error.

The variable of ``--stats-half-life`` is ``SPECMESH_STATS_HALF_LIFE``: one rule for every service,
so an operator never looks a name up. A repeatable flag reads its variable as a comma list.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_var(flag: str) -> str:
    """The environment variable that supplies a flag's default.

    >>> env_var("--stats-half-life")
    'SPECMESH_STATS_HALF_LIFE'
    """
    return "SPECMESH_" + flag.lstrip("-").upper().replace("-", "_")


def boolean(text: str) -> bool:
    """A yes/no value as a flag or a variable spells it.

    >>> boolean("on"), boolean("0")
    (True, False)
    """
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(text)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20}
_UNITS |= {"g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def byte_size(text: str) -> int | None:
    """A memory size, "auto" (None: the service picks) or a number with an optional unit.

    >>> byte_size("4GiB"), byte_size("512 MB"), byte_size("1000"), byte_size("auto")
    (4294967296, 512000000, 1000, None)
    """
    value = text.strip().lower()
    if value in ("auto", ""):
        return None
    number = value.rstrip("bikmgt ")
    unit = value[len(number) :].strip()
    if unit not in _UNITS or float(number) <= 0:
        raise ValueError(text)
    return int(float(number) * _UNITS[unit])


def _type_name(kind: Callable[[str], Any]) -> str:
    return {int: "integer", float: "number", boolean: "yes/no", byte_size: "size"}.get(
        kind, getattr(kind, "__name__", "value")
    )


class ServiceFlags:
    """An ``argparse`` parser for one service whose flags all follow the rule above.

    >>> f = ServiceFlags("specmesh serve demo", "A demo.")
    >>> f.add("--max-nodes", 16, int, "tree nodes per proposal")
    >>> f.parse(["--max-nodes", "8"]).max_nodes
    8
    """

    def __init__(self, prog: str, description: str) -> None:
        self.parser = argparse.ArgumentParser(
            prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        self._bad_env: list[str] = []
        self._minimum: dict[str, tuple[str, float]] = {}  # dest → (flag, least value), checked in parse
        self._addresses: dict[str, str] = {}  # dest → flag, a HOST:PORT checked in parse

    def add(
        self,
        flag: str,
        default: Any,
        kind: Callable[[str], Any],
        help: str,
        *,
        choices: Sequence[Any] | None = None,
        repeat: bool = False,
        metavar: str | None = None,
        minimum: float | None = None,
    ) -> None:
        """``flag`` of type ``kind`` (``int``, ``float``, ``str``, ``boolean`` or any converter);
        ``repeat``: the flag may be given several times and its value is a list; ``minimum``: the
        least value ``parse`` accepts (from the command line or the variable)."""
        var = env_var(flag)
        dest = flag.lstrip("-").replace("-", "_")
        if minimum is not None:
            self._minimum[dest] = (flag, minimum)
        raw = os.environ.get(var)
        if raw is not None:
            default = self._from_env(var, raw, kind, choices, repeat, default)
        kwargs: dict[str, Any] = {"type": kind, "default": default, "help": f"{help} [env {var}]"}
        if choices is not None:
            kwargs["choices"] = choices
        if metavar is not None:
            kwargs["metavar"] = metavar
        if repeat:
            kwargs["action"] = "append"
            kwargs["default"] = list(default or [])
        if kind is boolean:
            kwargs["metavar"] = metavar or "{yes,no}"
        self.parser.add_argument(flag, **kwargs)

    def add_address(self, flag: str, default: str, help: str) -> None:
        """A HOST:PORT flag; ``parse`` refuses any other shape.

        >>> f = ServiceFlags("x", "y")
        >>> f.add_address("--address", "127.0.0.1:50051", "where to listen")
        >>> f.parse([]).address
        '127.0.0.1:50051'
        """
        self.add(flag, default, str, help)
        self._addresses[flag.lstrip("-").replace("-", "_")] = flag

    def _from_env(
        self, var: str, raw: str, kind: Callable[[str], Any], choices: Sequence[Any] | None, repeat: bool, default: Any
    ) -> Any:
        items = [x.strip() for x in raw.split(",") if x.strip()] if repeat else [raw]
        try:
            values = [kind(x) for x in items]
        except (ValueError, TypeError):
            self._bad_env.append(f"{var}={raw!r} is not a valid {_type_name(kind)}")
            return default
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            self._bad_env.append(f"{var}={raw!r}: choose from {', '.join(map(str, choices))}")
            return default
        return values if repeat else values[0]

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The parsed flags; a bad variable or flag exits with one line (status 2), as argparse does."""
        if self._bad_env:
            self.parser.error("; ".join(self._bad_env))
        a = self.parser.parse_args(argv)
        for dest, flag in self._addresses.items():
            host, sep, port = getattr(a, dest).rpartition(":")
            if not sep or not host or not port.isdigit():
                self.error(f"{flag} expects HOST:PORT, got {getattr(a, dest)!r}")
        for dest, (flag, low) in self._minimum.items():
            at_least(self, flag, getattr(a, dest), low)
        return a

    def error(self, message: str) -> NoReturn:
        self.parser.error(message)


def at_least(flags: ServiceFlags | argparse.ArgumentParser, flag: str, value: float, low: float) -> Any:
    """``value`` if it is ≥ ``low``, else a one-line flag error naming the limit (for limits that
    depend on another flag, e.g. ``--max-n`` ≥ ``--min-n``; fixed ones are ``add(minimum=…)``, and
    the limits of tools parsed with plain argparse)."""
    if value < low:
        flags.error(f"{flag} must be >= {low}, got {value}")
    return value
