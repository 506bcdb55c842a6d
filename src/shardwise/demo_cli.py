"""``shardwise demo``'s command line, without torch: the options are parsed and checked
(mesh, processes, the plot's file) before torch is imported and training starts, so a usage
line or a refusal comes at once."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from .launch import positive_int

HEADS = 4  # the demo GPT's attention heads: the tensor-parallel size must divide them


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (2, 2): data-parallel size x tensor-parallel size."""
    try:
        dp, tp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh wants DPxTP such as 2x2, got {text!r}") from None
    if dp < 1 or tp < 1:
        raise argparse.ArgumentTypeError(f"--mesh sizes must be positive, got {text!r}")
    return dp, tp


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise demo",
        description="Train a small GPT with data x tensor (+ sequence) parallelism on a mesh of "
        "simulated devices, next to the same model on one device from the same seed; compare "
        "the losses step by step and show the communication and the parameter placements.",
    )
    parser.add_argument("--mesh", type=parse_mesh, default=(2, 2), metavar="DPxTP",
                        help="mesh shape: data-parallel x tensor-parallel size (default 2x2; "
                        "4x1, 1x4... work too)")
    parser.add_argument("--steps", type=positive_int,
                        default=30, help="training steps (default 30)")
    parser.add_argument("--batch", type=positive_int,
                        default=16, help="global batch size (default 16)")
    parser.add_argument("--lr", type=_positive_float, default=1e-2,
                        help="AdamW learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--layers", type=positive_int,
                        default=2, help="transformer blocks (default 2)")
    parser.add_argument("--tied", action="store_true",
                        help="tie the output head to the token embedding")
    parser.add_argument("--fsdp", action="store_true",
                        help="data parallel by fully_shard (parameters and optimizer state "
                        "Shard(0) on the data dim) instead of replicate")
    parser.add_argument("--nproc", type=positive_int, default=1,
                        help="run over this many gloo processes on this host (the mesh size "
                        "must be a multiple of it); prints the same losses")
    parser.add_argument("--plot", metavar="FILE",
                        help="write the loss curves and bytes per step to FILE (.png, .pdf, "
                        ".svg...; needs matplotlib: pip install 'shardwise[demo]')")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's options, checked: anything it cannot run with exits here with a one-line
    error (code 2), before training starts."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = mesh_problem(args.mesh, args.nproc) or (args.plot and plot_problem(args.plot))
    if problem:
        parser.error(problem)
    return args


def mesh_problem(mesh: tuple[int, int], nproc: int) -> str | None:
    """Why the demo cannot run on ``mesh`` over ``nproc`` processes, in one line (None: it
    can)."""
    dp, tp = mesh
    if HEADS % tp:
        fits = [n for n in range(1, HEADS + 1) if HEADS % n == 0]
        return (f"--mesh {dp}x{tp}: the tensor-parallel size must divide the model's {HEADS} "
                f"attention heads, so TP is one of {fits}")
    size = dp * tp
    if size % nproc:
        fits = [n for n in range(1, size + 1) if size % n == 0]
        choices = ", ".join(map(str, fits[:-1])) + f" or {fits[-1]}" if len(fits) > 1 else "1"
        return (f"--nproc {nproc} does not divide the {size} devices of --mesh {dp}x{tp}: use "
                f"--nproc {choices}, or a mesh whose size is a multiple of {nproc} (such as "
                f"--mesh {nproc}x1)")
    return None


def plot_problem(path: str) -> str | None:
    """Why the plot could not be written to ``path`` after training (None: it can)."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'shardwise[demo]' (or matplotlib)"
    folder = Path(path).parent
    if not folder.is_dir():
        return f"--plot {path}: the directory {str(folder)!r} does not exist"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = sorted(FigureCanvasAgg.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in kinds:
        return (f"--plot {path}: matplotlib cannot tell the image format from "
                f"{('.' + suffix) if suffix else 'a name without an extension'}; end the name "
                f"with one of {', '.join('.' + k for k in kinds)}")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``shardwise demo``: check the options, then run (or launch over ``--nproc``
    processes); exit 0 when the sharded losses match single-device training."""
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["demo"]:
        given = given[1:]
    args = parse(given)
    if args.nproc > 1:
        from .launch import launch

        return launch("shardwise", ["demo", *without_nproc(given)], nproc=args.nproc,
                      module=True)
    from .demo import run  # torch: only now

    result = run(args)
    return 0 if result.max_difference <= result.tolerance else 1


def without_nproc(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            kept.append(a)
    return kept
