"""The command line of the proposers' training tools (``specmesh draft distill``, ``specmesh head
train``): a tool with one subcommand whose ``--help`` shows every default, each flag's range
checked after parsing (a one-line error, status 2), and the parsed flags as the tool's config.

Plain ``argparse``, no ``SPECMESH_*`` variables: these are one-off commands, not services.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from specmesh_server.flags import at_least

Config = TypeVar("Config")


@dataclass(frozen=True)
class ToolFlag:
    """One flag of a training tool; ``required`` ones have no default (and show none)."""

    flag: str
    help: str
    kind: Callable[[str], Any] = str
    default: Any = None
    minimum: float | None = None  # the least value accepted
    below: float | None = None  # values must stay under this one
    required: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class ToolCommand:
    """A training tool (``prog``) and its one subcommand (``name``), flags in ``--help`` order."""

    prog: str
    description: str
    name: str
    summary: str  # the subcommand's line in the tool's --help
    detail: str  # the subcommand's own --help description
    flags: tuple[ToolFlag, ...]


_SHARED = {
    f.flag: f
    for f in (
        ToolFlag("--minutes", "wall-clock training budget", float, minimum=0),
        ToolFlag("--batch", "examples per step", int, minimum=1),
        ToolFlag("--lr", "AdamW learning rate", float, minimum=0),
        ToolFlag(
            "--generate-fraction",
            "share of the time budget spent generating the target's answers",
            float,
            minimum=0,
            below=1,
        ),
        ToolFlag("--threads", "torch threads", int, minimum=1),
        ToolFlag("--seed", "data order and initialisation", int),
    )
}


def target_flag(flag: str) -> ToolFlag:
    """The target model to train from (``--model`` for the draft, ``--target`` for the head)."""
    return ToolFlag(flag, "target: HF folder or .gguf; unset: SmolLM2-135M-Instruct")


def out_flag(help: str) -> ToolFlag:
    """Where the trained model goes (required)."""
    return ToolFlag("--out", help, required=True)


def shared_flag(flag: str, default: Any, help: str | None = None) -> ToolFlag:
    """A flag both tools take (``--minutes``, ``--batch``, ``--lr``, ``--generate-fraction``,
    ``--threads``, ``--seed``): its type and range, the tool's default and, where the tool's meaning
    is narrower, its own help.

    >>> f = shared_flag("--batch", 4, "sequences per step")
    >>> f.kind, f.default, f.minimum, f.help
    (<class 'int'>, 4, 1, 'sequences per step')
    """
    return replace(_SHARED[flag], default=default, help=help or _SHARED[flag].help)


def tool_parser(cmd: ToolCommand) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the tool's parser, its subcommand's)."""
    p = argparse.ArgumentParser(prog=cmd.prog, description=cmd.description)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        cmd.name, help=cmd.summary, description=cmd.detail, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for f in cmd.flags:
        if f.required:
            s.add_argument(f.flag, type=f.kind, required=True, default=argparse.SUPPRESS, help=f.help)
        else:
            s.add_argument(f.flag, type=f.kind, default=f.default, help=f.help)
    return p, s


def parse_tool(cmd: ToolCommand, argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed flags, every ``minimum`` and ``below`` checked (a flag error otherwise).

    >>> cmd = ToolCommand("demo", "A demo.", "run", "run it", "Run it.", (shared_flag("--threads", 2),))
    >>> parse_tool(cmd, ["run", "--threads", "4"]).threads
    4
    """
    p, s = tool_parser(cmd)
    a = p.parse_args(argv)
    for f in cmd.flags:
        value = getattr(a, f.dest)
        if f.minimum is not None:
            at_least(s, f.flag, value, f.minimum)
        if f.below is not None and value >= f.below:
            s.error(f"{f.flag} must be < {f.below}, got {value}")
    return a


def tool_config(cls: type[Config], a: argparse.Namespace) -> Config:
    """The tool's config (a dataclass): the fields parsed from flags of the same names, the rest default.

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Demo:
    ...     threads: int = 2
    ...     seed: int = 0
    >>> tool_config(Demo, argparse.Namespace(threads=4, out="x"))
    Demo(threads=4, seed=0)
    """
    return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if hasattr(a, f.name)})
