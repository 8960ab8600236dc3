"""The command-line reference, made from `agent_inbox.cli.build_parser()` at every
docs build (docs/hooks.py), so it cannot drift from the parsers.

Every command and nested subcommand gets a heading, its help, its usage and a
table of its arguments. Defaults are read with every AGENT_INBOX_* variable
unset, so the page shows the code's defaults, not the builder's environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

WIDTH = 88


@contextmanager
def _clean_environment() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("AGENT_INBOX_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias
                    continue
                seen.add(id(sub))
                found.append((name, helps.get(name, ""), sub))
    return found


def _cell(text: object) -> str:
    text = str(text).replace("\n", " ")
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, escaped)
    return text


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    metavar = ""
    if action.nargs != 0:
        formatter = argparse.HelpFormatter("x")
        metavar = " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return ", ".join(f"`{flag}{metavar}`" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, False):
        return ""
    if not action.option_strings:
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        params = dict(vars(action), prog="")
        text = text % params
    if action.choices and not action.option_strings:
        text = (text + " " if text else "") + "(one of: " + ", ".join(f"`{c}`" for c in action.choices) + ")"
    required = action.option_strings and action.required
    return ("(required) " if required else "") + text


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                   argparse._SubParsersAction)):
            continue
        rows.append(f"| {_flags(action)} | {_cell(_help(action))} | {_cell(_default(action))} |")
    if not rows:
        return []
    return ["| argument | meaning | default |", "|---|---|---|", *rows, ""]


def _section(parser: argparse.ArgumentParser, path: list[str], help_text: str, level: int) -> list[str]:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    title = " ".join(path)
    lines = [f"{'#' * min(level, 6)} {title}", ""]
    description = parser.description or help_text
    if description:
        lines += [description[0].upper() + description[1:] + ("" if description.endswith(".") else "."), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    lines += _arguments_table(parser)
    subcommands = _subcommands(parser)
    if subcommands:
        lines += ["Subcommands: " + ", ".join(f"`{name}`" for name, _, _ in subcommands) + ".", ""]
    for name, sub_help, sub in subcommands:
        lines += _section(sub, path + [name], sub_help, level + 1)
    return lines


def render() -> str:
    with _clean_environment():
        from agent_inbox.cli import build_parser

        parser = build_parser()
        parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
        lines = [
            "# Command line",
            "",
            "<!-- Generated from agent_inbox.cli.build_parser() by docs/gen_cli.py at every "
            "build: do not edit. -->",
            "",
            "Generated from the argparse parsers at every build, so it is what "
            "`agent-inbox ... --help` says. Every option also reads "
            "`AGENT_INBOX_<OPTION>` (`--lease-ttl`: `AGENT_INBOX_LEASE_TTL`); the "
            "defaults below are the code's, with no such variable set.",
            "",
            "```text",
            parser.format_usage().strip(),
            "```",
            "",
        ]
        for name, help_text, sub in _subcommands(parser):
            lines += _section(sub, ["agent-inbox", name], help_text, 2)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
