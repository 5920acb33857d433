"""The ``builder`` command line.

Each command is a module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
``builder`` imports only the module of the command being run (:func:`parser` with its name):
the other commands are listed by name and one-line help, read from :data:`COMMANDS` and from
the entry points' module docstrings without importing them, so a command's module may import
what it needs at its top and still not slow down another command. ``builder``'s own commands
are the other modules of ``builder/cli/`` (:data:`COMMANDS`); other packages add theirs through
the ``yamlformer.commands`` entry-point group (``name = "package.module"``; the module
docstring's first line is its help): the recipes' ``train``, ``eval``, ``generate`` and
``tokenize`` join so, declared in ``pyproject.toml``, and ``builder`` never imports ``recipes``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version

from yamlformer.builder import packages

#: builder's own commands: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("yamlformer.builder.cli.validate", "check spec files; one line per problem"),
    "schema": ("yamlformer.builder.cli.schema", "print the JSON Schema of a spec"),
    "describe": ("yamlformer.builder.cli.describe", "analytic parameters, FLOPs and memory of a spec"),
    "compare": ("yamlformer.builder.cli.compare", "estimated vs built parameter counts, by component"),
    "diff": ("yamlformer.builder.cli.diff", "fields that differ between two specs and their effect"),
    "plan": ("yamlformer.builder.cli.plan", "the cheapest multi-GPU layout that fits, with its launch lines"),
    "import-hf": ("yamlformer.builder.cli.import_hf", "a local Hugging Face model folder as spec.yaml + weights"),
    "export-hf": (
        "yamlformer.builder.cli.export_hf",
        "a spec and its weights (or a checkpoint) as a Hugging Face folder",
    ),
    "export-gguf": ("yamlformer.builder.cli.export_gguf", "a checkpoint or spec as one GGUF file that llama.cpp runs"),
    "consolidate": ("yamlformer.builder.cli.consolidate", "a sharded training checkpoint as one model.safetensors"),
    "list": ("yamlformer.builder.cli.list", "the zoo: shipped specs and recipes by name, family, size"),
    "cp": ("yamlformer.builder.cli.cp", "copy a zoo spec or recipe to a file to edit"),
}
#: other packages add commands here: ``[project.entry-points."yamlformer.commands"]``
GROUP = "yamlformer.commands"


def commands() -> dict[str, tuple[str, str]]:
    """Every command, name -> (module, one-line help): builder's own, then the entry points'
    (their help read from the module's source, not by importing it)."""
    table = dict(COMMANDS)
    for entry in importlib.metadata.entry_points(group=GROUP):
        table.setdefault(entry.name, (entry.value, help_of(docstring_of(entry.value))))
    return table


def docstring_of(module: str) -> str:
    """The docstring of the module named ``module``, read from its source file (its packages are
    imported to find it, the module itself is not); empty when it has none or cannot be found."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not spec.has_location:
        return ""
    try:
        with open(spec.origin, encoding="utf-8") as source:
            return ast.get_docstring(ast.parse(source.read(), spec.origin)) or ""
    except (OSError, SyntaxError, ValueError):
        return ""


def help_of(docstring: str) -> str:
    """A command module's one-line help: the first line of its docstring without the usage that
    opens it (```builder train RECIPE`: ``) and the full stop that ends it."""
    line = (docstring or "").strip().partition("\n")[0]
    return re.sub(r"^`+[^`]*`+:\s*", "", line).removesuffix(".")


class _Version(argparse.Action):
    """``--version``: this package and the libraries it runs on (imports torch only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit()


def versions() -> str:
    """One line: ``builder 0.2.0 (torch 2.13.0, lightning 2.6.6, triton 3.9.0, CUDA 12.8)``."""
    # local: the package's version (importlib.metadata), asked by --version only
    import yamlformer.builder

    parts = []
    for name in ("torch", "lightning", "triton"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    # local: torch loads for --version alone (every other start of builder stays torch-free)
    import torch

    parts.append(f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build")
    if torch.cuda.is_available():
        parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return f"builder {yamlformer.builder.__version__} ({', '.join(parts)})"


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help line ends with its default: the help's own words when they name it
    ("default: the recipe's"), else one :func:`default_text` writes from the option's value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)


def help_with_default(action: argparse.Action) -> str:
    """``action``'s help (a ``%``-format string, as argparse expands it) with its default."""
    text = action.help or ""
    if not action.option_strings or action.help is argparse.SUPPRESS or "default" in text.lower():
        return text
    suffix = default_text(action)
    return f"{text} ({suffix})" if suffix else text


def default_text(action: argparse.Action) -> str | None:
    """``required``, ``default: off`` for a flag, ``default: none`` for an empty repeatable option,
    ``default: VALUE`` otherwise; ``None`` when the default is ``None`` (its meaning cannot be
    guessed: the help must say it, and ``tests/test_cli_help.py`` checks that it does)."""
    if action.required:
        return "required"
    if action.default is argparse.SUPPRESS:
        return None
    if action.nargs == 0:  # store_true, store_false, store_const, count
        return "default: off"
    if action.default == [] and isinstance(action, argparse._AppendAction):
        return "default: none"
    if action.default is None:
        return None
    return f"default: {action.default}".replace("%", "%%")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: the option, what it takes, and where help is
    (argparse prints the whole usage block first). Exit status 2, a usage error."""

    #: what is missing when the package was never installed (no entry points), said with a
    #: command that is not there
    missing: str | None = None

    def error(self, message: str):
        if self.missing and "invalid choice" in message:
            message = f"{message}; {self.missing}"
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


#: :func:`parser`'s default: every command's arguments (the shell completion scripts, the tests
#: that read every option)
EVERY = "*"


def parser(command: str | None = EVERY) -> argparse.ArgumentParser:
    """``builder``'s parser: every command listed, and the arguments of ``command`` (its module
    imported), of every command (:data:`EVERY`) or of none (``None``: ``builder --help``)."""
    # local: shtab is needed only where the completion option is added, every parser here
    import shtab

    root = ArgumentParser(
        prog="builder",
        description="Declarative Transformer specs: validate, size, build, train.",
        formatter_class=HelpFormatter,
    )
    root.add_argument(
        "--version", action=_Version, help="print the versions of builder, torch, Lightning, Triton and CUDA"
    )
    # `builder --print-completion bash|zsh|tcsh`: shtab writes the script from this parser
    shtab.add_argument_to(
        root,
        ["--print-completion"],
        help='print a shell completion script: `eval "$(builder --print-completion bash)"` '
        "in ~/.bashrc (zsh: see the README)",
        preamble={"bash": _ZOO_BASH},
    )
    sub = root.add_subparsers(dest="command", metavar="COMMAND", required=True)
    table = commands()
    if table.keys() == COMMANDS.keys():  # no entry point: a checkout that was never installed?
        if not packages.installed():
            root.epilog = root.missing = packages.NOT_INSTALLED
    for name, (module, help_text) in table.items():
        if command not in (EVERY, name):
            sub.add_parser(name, help=help_text)  # named and helped; never parsed in this run
            continue
        one = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        importlib.import_module(module).add_arguments(one)
        one.set_defaults(_module=module)
        _complete_files(one)
    return root


def command_in(argv: list[str]) -> str | None:
    """The command ``argv`` runs (its first word that is not an option), :data:`EVERY` where it
    asks for a completion script (written from every command's options), ``None`` for none."""
    for word in argv:
        if word == "--print-completion" or word.startswith("--print-completion="):
            return EVERY
        if word == "--":
            return None
        if not word.startswith("-"):
            return word
    return None


#: bash: a positional that takes a zoo name completes zoo names (`builder list --names`, which
#: reads only the zoo's folders) and files
_ZOO_BASH = """
_builder_zoo_or_files() {
  compgen -W "$(builder list --names 2>/dev/null)" -- "$1"
  compgen -f -- "$1"
}
"""


def _complete_files(command: argparse.ArgumentParser) -> None:
    """Positional arguments (a spec, recipe, checkpoint or folder) complete as paths in the shell;
    one whose help says it takes a zoo entry completes zoo names too (bash)."""
    # local: shtab is needed only where the completion option is added, every parser here
    import shtab

    for action in command._actions:
        if not action.option_strings and action.dest not in ("help", "command") and action.choices is None:
            zoo = "zoo" in (action.help or "")  # "a spec file or a zoo name", "a zoo recipe by name"
            action.complete = {**shtab.FILE, "bash": "_builder_zoo_or_files"} if zoo else shtab.FILE


#: the exit status of an internal error (a bug): BSD's EX_SOFTWARE
INTERNAL_ERROR = 70


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (see ``yamlformer.builder.cli.arguments`` for their meaning).

    Every failure a user can cause has its own one-line message where it happens. What escapes
    them is a bug: caught here as a last resort, printed as one line asking for a report (the
    traceback too under ``BUILDER_DEBUG=1``), exit status 70.
    """
    problem = packages.foreign()
    if problem:
        print(f"builder: {problem}", file=sys.stderr)
        return 1
    try:
        words = sys.argv[1:] if argv is None else argv
        args = parser(command_in(words)).parse_args(words)
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        print("\nbuilder: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`builder schema | head`): nothing more to say
        _silence_stdout()
        return 141
    except Exception as exc:
        return internal_error(exc)


def internal_error(exc: BaseException) -> int:
    """One line for an error no command caught (a bug), the traceback only under BUILDER_DEBUG=1."""
    if os.environ.get("BUILDER_DEBUG", "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    # the exception's type, its message and where it was raised in our code
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if any(f"{os.sep}{package}{os.sep}" in f.filename for package in ("builder", "blocks", "kernels", "recipes"))
    ]
    where = f" in {_short(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    print(
        f"builder: internal error: {type(exc).__name__}{where}: {exception_message(exc)}; please report it with "
        "`builder --version` and the command (BUILDER_DEBUG=1 shows the traceback)",
        file=sys.stderr,
    )
    return INTERNAL_ERROR


#: the most of an exception's message an internal-error line shows
MESSAGE_CHARS = 200


def exception_message(exc: BaseException) -> str:
    """The exception's own message as one short line: its first line, cut at
    :data:`MESSAGE_CHARS` characters, so a message that quotes an input (a YAML or JSON parser's
    excerpt of a file) can show at most a fragment of one line of it, never the file."""
    lines = str(exc).strip().splitlines()
    first = " ".join(lines[0].split()) if lines else ""
    if not first:
        return "(no message)"
    if len(first) > MESSAGE_CHARS or len(lines) > 1:
        first = first[:MESSAGE_CHARS].rstrip() + " ..."
    return first


def _short(filename: str) -> str:
    """``.../site-packages/builder/loader.py`` -> ``builder/spec/loader.py``."""
    parts = filename.split(os.sep)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("builder", "blocks", "kernels", "recipes"):
            return "/".join(parts[i:])
    return parts[-1]


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
