"""The rules every command applies to what it is given, in one place, so that a wrong input is one line and exit
code 2 whichever option or command it reaches (stackcheck.cli builds its parser from `Parser`): no empty value,
comma-separated list options (`LIST_OPTIONS`) without blank or repeated items, one value for any other option,
and a path that names what it must be (`existing_file`, `existing_folder`). The rules: docs/inputs.md.
"""

from __future__ import annotations

import argparse
import difflib
import tempfile
from pathlib import Path

from stackcheck.core.versions import UsageError, VersionSet, default_set, resolve

# The comma-separated options: `--sets` of the commands that take several sets, and these.
LIST_OPTIONS = ("--families", "--arch", "--candidates")


def _shown(text: str) -> str:
    return repr(text) if text.strip() != text or not text else f"'{text}'"


def list_items(option: str, text: str) -> list[str]:
    """The items of one comma-separated value: stripped, none empty or blank, none twice."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise UsageError(f"{option} {_shown(text)} names nothing: name at least one item (an empty value is never 'all')")
    if not all(items):
        raise UsageError(f"{option} {_shown(text)} has an empty item: separate names with single commas")
    return unique(option, items)


def unique(option: str, items: list[str]) -> list[str]:
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise UsageError(f"{option} names {', '.join(repeated)} more than once")
    return items


def nonblank(option: str, text: str) -> str:
    if not text.strip():
        raise UsageError(f"{option} {_shown(text)}: an empty value names nothing")
    return text


def _given(namespace) -> dict:
    """The options given so far on the command line (argparse cannot tell a default from a value given)."""
    if not hasattr(namespace, "_stackcheck_given"):
        namespace._stackcheck_given = {}
    return namespace._stackcheck_given


class ListOption(argparse.Action):
    """A comma-separated list, kept as the comma-joined text of its checked items; repeated, it adds its items."""

    def __call__(self, parser, namespace, values, option_string=None):
        option = self.option_strings[0]
        items = list_items(option_string or option, values)
        given = _given(namespace)
        combined = unique(option, [*given.get(self.dest, []), *items])
        given[self.dest] = combined
        setattr(namespace, self.dest, ",".join(combined))


class OneName(argparse.Action):
    """`--sets` of a command that runs one set: one name, given once (or the same name again)."""

    def __call__(self, parser, namespace, values, option_string=None):
        option = option_string or self.option_strings[0]
        name = nonblank(option, values).strip()
        command = parser.prog.split()[-1]
        if "," in name:
            raise UsageError(f"{command} runs one set, not {_shown(name)} (the matrix takes several: --sets a,b)")
        given = _given(namespace)
        if given.get(self.dest, name) != name:
            raise UsageError(f"{command} runs one set: {option} names {given[self.dest]} and {name}; keep one")
        given[self.dest] = name
        setattr(namespace, self.dest, name)


class StoreOnce(argparse._StoreAction):
    """An option of one value: given twice, the values must agree."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = _given(namespace)
        if self.dest in given and given[self.dest] != values:
            raise UsageError(f"{option_string} given twice ({_value(given[self.dest])} and {_value(values)}): keep one")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


def _value(value) -> str:
    return _shown(value) if isinstance(value, str) else str(value)


def _checked_type(option: str, convert):
    """`convert` (argparse's `type`) of a value that is not empty or blank."""

    def check(text: str):
        nonblank(option, text)
        return convert(text) if convert else text

    check.__name__ = getattr(convert, "__name__", "text")  # argparse names the type in its own messages
    return check


class Parser(argparse.ArgumentParser):
    """argparse with the rules above: its errors are one line (UsageError), no option takes an empty value, a
    list option adds and checks its items, and any other option takes one value."""

    def add_argument(self, *names, **kwargs):
        option = names[0] if names[0].startswith("-") else (kwargs.get("metavar") or kwargs.get("dest") or names[0]).upper()
        action = kwargs.get("action")
        if action in (None, "store", "append", ListOption, OneName) and kwargs.get("nargs") != "*":  # "*": pytest's own arguments
            kwargs["type"] = _checked_type(option, kwargs.get("type"))
        if action in (None, "store") and names[0].startswith("-") and kwargs.get("nargs") is None:
            kwargs["action"] = StoreOnce
        return super().add_argument(*names, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, with what is left over refused by the command's own parser (which can name `--`)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands: dict[str, argparse.ArgumentParser] = {}
            if self._subparsers:
                subcommands = self._subparsers._group_actions[0]
                assert isinstance(subcommands, argparse._SubParsersAction), "add_subparsers comes before any positional"
                commands = subcommands.choices
            commands.get(getattr(parsed, "command", ""), self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str):
        hint = ""
        unknown = message.removeprefix("unrecognized arguments: ").split() if message.startswith("unrecognized arguments") else []
        mine = [name for action in self._actions for name in action.option_strings if action.help != argparse.SUPPRESS]
        close = [match[0] for given in unknown if given.startswith("--")
                 for match in [difflib.get_close_matches(given.split("=", 1)[0], mine, n=1, cutoff=0.75)] if match]
        if close:  # a misspelt option of the command's own (`--famlies`), not one of pytest's
            hint = f"; did you mean {', '.join(close)}?"
        elif unknown and any(a.dest == "pytest_args" for a in self._actions):
            hint = f" (pytest's own options go after `--`: {self.prog} ... -- -k NAME)"
        command = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        raise UsageError(f"{command}{message}{hint}")


def existing_file(option: str, path: Path) -> Path:
    """A file the command reads: it exists and is no folder."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; name a file")
    if not path.exists():
        raise UsageError(f"{option} {path}: no such file")
    return path


def existing_folder(option: str, path: Path) -> Path:
    """A folder the command reads: it exists and is no file."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file; name a folder")
    if not path.is_dir():
        raise UsageError(f"{option} {path}: no such folder")
    return path


def interpreter(option: str, text: str) -> str:
    """A Python interpreter to run: a path to a file (a folder is named as such, an environment's with its
    bin/python), or a name on PATH."""
    path = Path(text).expanduser()
    if path.is_dir():
        inside = next((str(candidate) for candidate in (path / "bin" / "python", path / "python") if candidate.is_file()), None)
        raise UsageError(f"{option} {text} is a folder; name a Python interpreter" + (f", such as {inside}" if inside else ""))
    if "/" in text and not path.exists():
        raise UsageError(f"{option} {text}: no such file")
    return text


def check_file_option(option: str, path: Path) -> None:
    """An option naming a file to write: refused up front when a folder is in the way or its folder takes no file.
    Every such file is JSON, with its .md (and .png) written beside it: a name without .json would have them clash."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; name the file to write")
    if path.suffix != ".json":
        raise UsageError(f"{option} {path}: name a .json file (its .md is written beside it)")
    check_writable(option, path.parent)


def check_folder_option(option: str, path: Path) -> None:
    """An option naming a folder to write into: refused up front when a file is in the way or it takes no file."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file; name a folder")
    check_writable(option, path)


def check_writable(option: str, folder: Path) -> None:
    """A file can be created in `folder`, or in its nearest existing ancestor when it is still to be made: tried
    for real, since root passes every permission check on /proc or a read-only mount (found here, not after a build)."""
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if not existing.is_dir():
        raise UsageError(f"{option}: {existing} is a file, so {folder} cannot be a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise UsageError(f"{option}: cannot write in {existing} ({exc.strerror})") from None


def selected_sets(args) -> list[VersionSet]:
    """The sets a command runs: --sets (the default set for `tests`), with the --with pins applied."""
    names = args.sets.split(",") if args.sets else None
    if args.command == "tests" and names is None:
        names = [default_set().name]
    return resolve(names, args.overrides)
