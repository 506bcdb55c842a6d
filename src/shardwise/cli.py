"""Command line: ``shardwise demo`` trains a sharded GPT beside a single-device one
(``shardwise.demo``), ``shardwise tour`` shows the data model on a 2x3 mesh, ``shardwise
launch`` (also ``shardwise-run``) runs a script over N processes or rank threads
(``shardwise.launch``). Arguments are parsed before torch is imported."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # its own options: shardwise demo --help
        from .demo_cli import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["launch"]:  # its own options: shardwise launch --help
        from .launch import main as launch_main

        return launch_main(argv[1:])
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="train a small GPT with data x tensor parallelism next to single-device training "
        "(see shardwise demo --help)",
    )
    sub.add_parser("tour", help="show the data model on a 2x3 mesh of simulated devices")
    sub.add_parser(
        "launch",
        help="run a script over N local processes (gloo) or rank threads, like torchrun "
        "(see shardwise launch --help; also the shardwise-run command)",
    )
    args = parser.parse_args(argv)
    if args.command == "tour":
        from .tour import tour  # torch: only now

        tour()
    return 0
