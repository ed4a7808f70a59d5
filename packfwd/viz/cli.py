"""``python -m packfwd`` (or the ``packfwd`` console script): layouts for quick questions, as text.

    python -m packfwd plan --tp 2 --cp 2 --lengths 5,17,3 [--seq-align N]
    python -m packfwd layers --layers 32 --pp 4 --vpp 2 [--first N] [--last N] [--owner L]

Every error, whether argparse finds it or packfwd's planning functions do, is worded with this command line's
flags (``--tp``, not ``tp_size``), goes to stderr after the usage line and exits with status 2, argparse's
convention; none prints a traceback.  A flag given twice is an error, not a silent override.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from packfwd import layer_owner

from .text import describe_layers, describe_padding, describe_thd, thd_plans

_PLAN_EXAMPLE = "python -m packfwd plan --tp 2 --cp 2 --lengths 5,17,3"
_LAYERS_EXAMPLE = "python -m packfwd layers --layers 32 --pp 4 --vpp 2"

# The Python argument behind each flag, as packfwd's functions name it in their error messages.
_FLAGS = {
    "tp_size": "--tp",
    "cp_size": "--cp",
    "seq_align": "--seq-align",
    "num_layers": "--layers",
    "pp": "--pp",
    "vpp": "--vpp",
    "first_stage_layers": "--first",
    "last_stage_layers": "--last",
}
_NAMES = "|".join(sorted(_FLAGS, key=len, reverse=True))
_WORD = rf"(?<![\w-])({_NAMES})(?!\w)"


def _cli_words(message: str) -> str:
    """An error message of packfwd's functions reworded with the flags of this command line:
    ``pass x=None or x=8`` -> ``leave --x out or pass --x 8``, ``2*cp_size=4`` -> ``4 (2 x --cp)``,
    ``pp=4`` -> ``--pp 4``, any other ``tp_size`` -> ``--tp``."""
    message = re.sub(rf"pass {_WORD}=None or \1=(\w+)",
                     lambda m: f"leave {_FLAGS[m[1]]} out or pass {_FLAGS[m[1]]} {m[2]}", message)
    message = re.sub(r"\bor None for", "or leave it out for", message)
    message = re.sub(rf"(\d+)\*{_WORD}=(\d+)", lambda m: f"{m[3]} ({m[1]} x {_FLAGS[m[2]]})", message)
    message = re.sub(rf"{_WORD}=(-?\w+)", lambda m: f"{_FLAGS[m[1]]} {m[2]}", message)
    message = re.sub(r"\blayer=(-?\d+)", r"--owner \1", message)
    return re.sub(_WORD, lambda m: _FLAGS[m[1]], message)


def _lengths(text: str) -> list[int]:
    """``"5,17,3"`` -> ``[5, 17, 3]``: comma-separated non-negative integers, blanks around entries allowed."""
    form = "--lengths takes comma-separated non-negative integers, e.g. --lengths 5,17,3"
    parts = [part.strip() for part in text.split(",")]
    if parts == [""]:
        raise argparse.ArgumentTypeError(f"no lengths given; {form}")
    for i, part in enumerate(parts, 1):
        where = f" in {text!r}" if len(parts) > 1 else ""
        if not part:
            raise argparse.ArgumentTypeError(f"entry {i}{where} is empty; {form}")
        if re.fullmatch(r"-\d+", part):
            raise argparse.ArgumentTypeError(f"{part}{where} is negative; {form}")
        if not re.fullmatch(r"\d+", part):
            raise argparse.ArgumentTypeError(f"{part!r}{where} is not an integer; {form}")
        if int(part) > MAX_LENGTH:
            raise argparse.ArgumentTypeError(f"{part}{where} is over {MAX_LENGTH:,} tokens, more than a layout to "
                                             "look at; the library plans any length (packfwd.plan_thd)")
    return [int(part) for part in parts]


MAX_LENGTH = 1 << 20  # a sequence the CLI draws: a million tokens
CLI_TOKENS = 4096  # a rank's tokens the CLI names one by one


def _count(flag: str, minimum: int | None, example: int):
    """An argparse type: an integer (>= ``minimum`` unless it is None), with a message naming ``flag`` otherwise."""
    wanted = "an integer" if minimum is None else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*-?\d+\s*", text) or (minimum is not None and int(text) < minimum):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}; e.g. {flag} {example}")
        return int(text)

    return parse


class _Once(argparse.Action):
    """Store the value, refusing a second occurrence of the flag (argparse would keep the last one silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given", set())
        if self.dest in given:
            parser.error(f"{option_string} is given twice; give it once")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
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
    plan.add_argument("--lengths", type=_lengths, required=True, action=_Once,
                      help="comma-separated sequence lengths, e.g. 5,17,3")
    plan.add_argument("--tp", type=_count("--tp", 1, 2), default=1, action=_Once,
                      help="tensor-parallel size (sequence parallel splits by it)")
    plan.add_argument("--cp", type=_count("--cp", 1, 2), default=1, action=_Once, help="context-parallel size")
    plan.add_argument(
        "--seq-align",
        type=_count("--seq-align", 1, 8),
        default=None,
        action=_Once,
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
    layers.add_argument("--layers", type=_count("--layers", 1, 32), required=True, action=_Once,
                        help="decoder layers in the model")
    layers.add_argument("--pp", type=_count("--pp", 1, 4), default=1, action=_Once, help="pipeline-parallel size")
    layers.add_argument("--vpp", type=_count("--vpp", 1, 2), default=1, action=_Once,
                        help="virtual stages per pipeline rank (1: no interleaving)")
    layers.add_argument("--first", type=_count("--first", 1, 6), default=None, action=_Once,
                        help="layers on the first pipeline rank (uneven split)")
    layers.add_argument("--last", type=_count("--last", 1, 6), default=None, action=_Once,
                        help="layers on the last pipeline rank (uneven split)")
    layers.add_argument("--owner", type=_count("--owner", None, 21), default=None, action=_Once, metavar="LAYER",
                        help="also say where this layer lives")
    return parser, {"plan": plan, "layers": layers}


def _plan(args: argparse.Namespace) -> str:
    kwargs = dict(tp_size=args.tp, cp_size=args.cp, seq_align=args.seq_align)
    # checks the sizes first; every token of a rank up to CLI_TOKENS of them, each sequence's ranges past it
    layout = describe_thd(args.lengths, **kwargs, token_limit=CLI_TOKENS)
    head = f"THD layout of lengths {args.lengths}, tp={args.tp}, cp={args.cp}"
    if args.seq_align is not None:
        head += f", seq_align={args.seq_align}"
    parts = [head, layout]
    if args.tp > 1:
        local = thd_plans(args.lengths, **kwargs)[0].local_tokens
        parts.append(f"sequence parallel: each cp rank's {local} tokens split over tp={args.tp} ranks, "
                     f"{local // args.tp} each")
    parts += ["", "padding, against verl's alignment (2*tp*cp, or tp without CP):"]
    parts.append(describe_padding(args.lengths, **kwargs))
    return "\n".join(parts)


def _layers(args: argparse.Namespace) -> str:
    kwargs = dict(first_stage_layers=args.first, last_stage_layers=args.last)
    text = describe_layers(args.layers, args.pp, args.vpp, **kwargs)  # checks the sizes first
    if args.owner is not None:
        if not 0 <= args.owner < args.layers:
            raise ValueError(f"--owner {args.owner} is out of range; this model has layers 0..{args.layers - 1}")
        owner = layer_owner(args.owner, args.layers, args.pp, args.vpp, **kwargs)
        text += (
            f"\nlayer {args.owner}: pp rank {owner.pp_rank}, vpp stage {owner.vpp_rank}, "
            f"local index {owner.local_index}"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    0 on success (and for ``--help``); 2 for any error, whose message goes to stderr.

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
    parser, commands = _parser()
    try:
        args = parser.parse_args(argv)
        try:
            text = _plan(args) if args.command == "plan" else _layers(args)
        except (ValueError, TypeError) as error:
            commands[args.command].error(_cli_words(str(error)))  # usage and message to stderr, exit 2
    except SystemExit as exit_:  # --help (0) or an error (2, already printed)
        return 0 if exit_.code is None else int(exit_.code)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
