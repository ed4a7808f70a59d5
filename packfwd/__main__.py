"""``python -m packfwd`` (or the ``packfwd`` console script): layouts for quick questions, as text.

    python -m packfwd plan --tp 2 --cp 2 --lengths 5,17,3 [--seq-align N]
    python -m packfwd layers --layers 32 --pp 4 --vpp 2 [--first N] [--last N] [--owner L]

Bad sizes print packfwd's own error message (which names the argument and the fix) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

_PLAN_EXAMPLE = "python -m packfwd plan --tp 2 --cp 2 --lengths 5,17,3"
_LAYERS_EXAMPLE = "python -m packfwd layers --layers 32 --pp 4 --vpp 2"


def _lengths(text: str) -> list[int]:
    """``"5,17,3"`` -> ``[5, 17, 3]``; argparse turns the ValueError into a usage error."""
    try:
        lengths = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 5,17,3, got {text!r}") from None
    if not lengths:
        raise argparse.ArgumentTypeError("give at least one sequence length, e.g. --lengths 5,17,3")
    if any(n < 0 for n in lengths):
        raise argparse.ArgumentTypeError(f"sequence lengths must be >= 0, got {text!r}")
    return lengths


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packfwd",
        description="Show packfwd layouts: the THD layout of a ragged batch on each context-parallel rank, "
        "or which pipeline stage builds each transformer layer.",
        epilog=f"examples:\n  {_PLAN_EXAMPLE}\n  {_LAYERS_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,layers}")

    plan = commands.add_parser(
        "plan",
        help="each CP rank's THD tokens, cu_seqlens and the padding against verl's alignment",
        description="Each context-parallel rank's THD tensor for sequences of the given lengths: token a3 is "
        "the 4th token of the first sequence, '.' is padding, '|' separates sequences.",
        epilog=f"example:\n  {_PLAN_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--lengths", type=_lengths, required=True, help="comma-separated sequence lengths, e.g. 5,17,3")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallel splits by it)")
    plan.add_argument("--cp", type=int, default=1, help="context-parallel size")
    plan.add_argument(
        "--seq-align",
        type=int,
        default=None,
        help="pad every sequence to a multiple of this (default: the smallest valid one, 2*cp, or 1 without CP)",
    )

    layers = commands.add_parser(
        "layers",
        help="the global layers each pipeline rank and virtual stage builds",
        description="Which global layers every pipeline rank builds in each virtual stage, as Megatron-Core "
        "places them.",
        epilog=f"example:\n  {_LAYERS_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    layers.add_argument("--layers", type=int, required=True, help="decoder layers in the model")
    layers.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    layers.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank (1: no interleaving)")
    layers.add_argument("--first", type=int, default=None, help="layers on the first pipeline rank (uneven split)")
    layers.add_argument("--last", type=int, default=None, help="layers on the last pipeline rank (uneven split)")
    layers.add_argument("--owner", type=int, default=None, metavar="LAYER", help="also say where this layer lives")
    return parser


def _plan(args: argparse.Namespace) -> str:
    from .show import describe_padding, describe_thd

    kwargs = dict(tp_size=args.tp, cp_size=args.cp, seq_align=args.seq_align)
    layout = describe_thd(args.lengths, **kwargs)  # checks the sizes first
    head = f"THD layout of lengths {args.lengths}, tp={args.tp}, cp={args.cp}"
    if args.seq_align is not None:
        head += f", seq_align={args.seq_align}"
    parts = [head, layout]
    if args.tp > 1:
        local = _local_tokens(args.lengths, **kwargs)
        split = f"{local // args.tp} each"
        parts.append(f"sequence parallel: each cp rank's {local} tokens split over tp={args.tp} ranks, {split}")
    parts += ["", "padding, against verl's alignment (2*tp*cp, or tp without CP):"]
    parts.append(describe_padding(args.lengths, **kwargs))
    return "\n".join(parts)


def _local_tokens(lengths: Sequence[int], **kwargs) -> int:
    from .show import lengths_mask
    from .thd import plan_thd

    return plan_thd(lengths_mask(lengths), **kwargs).local_tokens


def _layers(args: argparse.Namespace) -> str:
    from .layers import layer_owner
    from .show import describe_layers

    kwargs = dict(first_stage_layers=args.first, last_stage_layers=args.last)
    text = describe_layers(args.layers, args.pp, args.vpp, **kwargs)
    if args.owner is not None:
        owner = layer_owner(args.owner, args.layers, args.pp, args.vpp, **kwargs)
        text += (
            f"\nlayer {args.owner}: pp rank {owner.pp_rank}, vpp stage {owner.vpp_rank}, "
            f"local index {owner.local_index}"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    0 on success (and for ``--help``), 2 for a usage error or sizes packfwd rejects (its message goes to stderr).

    >>> main(["layers", "--layers", "4", "--pp", "2"])
    4 layers, pp=2, vpp=1
    pp rank  vpp 0  layers
    0        0-1    2
    1        2-3    2
    layer      0123
    pp rank 0  00..
    pp rank 1  ..00
    0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2, already printed by argparse)
        return 0 if exit_.code is None else int(exit_.code)
    try:
        text = _plan(args) if args.command == "plan" else _layers(args)
    except (ValueError, TypeError) as error:
        print(f"packfwd {args.command}: error: {error}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
