"""The command-line reference, ``docs/cli.md``, rendered from the argument parser itself.

    python -m strata.launch.cli.reference docs/cli.md    # rewrite the file
    python -m strata.launch.cli.reference                # print it instead

``cli_reference()`` walks ``build_parser()``: every command and nested subcommand, each flag
with its value, default, choices and help. The engine flags (``EngineArgs.add_cli_args``),
which every command that starts an engine takes, are rendered once in a section of their own
and named by each such command. ``tests/launch/test_cli_reference.py`` fails when the
file and the parser disagree.

The parser is imported inside ``cli_reference``: importing this module loads nothing else.
"""

import argparse
import math
import sys
from pathlib import Path

REGENERATE = "python -m strata.launch.cli.reference docs/cli.md"
ENGINE_FLAGS = "engine-flags"  # the anchor of the "Engine flags" heading


def cli_reference() -> str:
    """``docs/cli.md``: the ``strata`` command's reference, as Markdown."""
    from strata.launch.cli.main import build_parser
    from strata.runtime.engine_args import EngineArgs

    engine_parser = argparse.ArgumentParser(add_help=False)
    EngineArgs.add_cli_args(engine_parser)
    engine_rows = {_row(action) for action in _options(engine_parser)}

    lines = [
        "# Command-line reference",
        "",
        "Generated from the argument parser (`strata.launch.cli.main.build_parser()`) by",
        f"`{REGENERATE}`, which rewrites this file (without a path it prints",
        "the reference instead). Do not edit it by hand: `tests/launch/test_cli_reference.py` fails",
        "when it differs from what the parser gives.",
        "",
        "A value of `switch` is a flag that takes no value; `repeatable` flags may be given several",
        "times. A bad flag value is one line on stderr and exit status 2.",
        "",
    ]
    engine_commands: list[str] = []
    lines += _command(build_parser(), "strata", "", engine_rows, engine_commands)
    lines += [
        "## Engine flags",
        "",
        f"Taken by every command that starts an engine ({', '.join(f'`{name}`' for name in engine_commands)});",
        "declared in `runtime/engine_args.py` (`EngineArgs`).",
        "",
        *_table([_row(action) for action in _options(engine_parser)]),
    ]
    return "\n".join(lines) + "\n"


def _command(
    parser: argparse.ArgumentParser,
    name: str,
    help_text: str,
    engine_rows: set[tuple[str, ...]],
    engine_commands: list[str],
) -> list[str]:
    """A command's section, then its subcommands' sections, depth first. ``engine_commands``
    collects the commands that take every engine flag."""
    depth = min(name.count(" ") + 1, 4)
    lines = [f"{'#' * (depth + 1)} `{name}`", ""]
    subcommands = _subcommands(parser)
    for text in (help_text, parser.description):
        if text:
            lines += [_cell(text[0].upper() + text[1:]) + ("" if text.rstrip().endswith(".") else "."), ""]
    rows = [_row(action) for action in _options(parser)]
    # A command that takes every engine flag lists only its own; the engine's come once, at the end.
    takes_engine_flags = bool(engine_rows) and engine_rows <= set(rows)
    own = [row for row in rows if row not in engine_rows] if takes_engine_flags else rows
    if own:
        lines += _table(own)
    for group in parser._mutually_exclusive_groups:
        names = ", ".join(f"`{action.option_strings[0]}`" for action in group._group_actions)
        lines += [f"{'Exactly one' if group.required else 'At most one'} of {names}.", ""]
    if takes_engine_flags:
        lines += [f"Also every [engine flag](#{ENGINE_FLAGS}).", ""]
        engine_commands.append(name)
    if subcommands:
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| `{name} {sub}` | {_escape(_cell(help_text))} |" for sub, help_text, _ in subcommands]
        lines.append("")
    for sub, sub_help, subparser in subcommands:
        lines += _command(subparser, f"{name} {sub}", sub_help, engine_rows, engine_commands)
    return lines


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(sub, helps.get(sub, ""), subparser) for sub, subparser in action.choices.items()]
    return found


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every flag and positional argument but ``--help`` and the subcommand choice."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and action.help != argparse.SUPPRESS
    ]


def _row(action: argparse.Action) -> tuple[str, ...]:
    names = ", ".join(f"`{option}`" for option in action.option_strings) or f"`{action.dest}`"
    return (names, _value(action), _default(action), _choices(action), _help(action))


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        kind = "switch"
    elif action.nargs == argparse.REMAINDER:
        kind = "the rest of the line"
    elif action.nargs in ("*", "+"):
        kind = "zero or more" if action.nargs == "*" else "one or more"
    elif action.metavar:
        kind = str(action.metavar)
    else:
        kind = {int: "integer", float: "number"}.get(action.type, "text")
    if isinstance(action, argparse._AppendAction):
        kind += ", repeatable"
    if action.required and action.option_strings:
        kind += ", required"
    return kind


def _default(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 and isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == argparse.SUPPRESS or (isinstance(default, list) and not default):
        return "unset"
    if isinstance(default, float) and math.isinf(default):
        return "`inf`"
    if isinstance(default, (list, tuple)):
        return ", ".join(f"`{item}`" for item in default)
    return f"`{default}`"


def _choices(action: argparse.Action) -> str:
    if action.choices is None:
        return ""
    return ", ".join(f"`{choice}`" for choice in action.choices)


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own substitutions, as --help shows them
        params = {**vars(action), "prog": "strata"}
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    return _cell(text)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| flag | value | default | choices | help |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_escape(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _cell(text: str) -> str:
    """One line: a table cell, or a paragraph (wrapping is the reader's)."""
    return " ".join(text.split())


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m strata.launch.cli.reference", description="Render the strata command's reference as Markdown."
    )
    parser.add_argument("path", nargs="?", default=None, help="write it here (docs/cli.md); unset: print it")
    args = parser.parse_args(argv)
    reference = cli_reference()
    if args.path is None:
        sys.stdout.write(reference)
    else:
        Path(args.path).write_text(reference)


if __name__ == "__main__":
    main()
