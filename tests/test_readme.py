"""The commands the READMEs show parse: every `builder ...` line of their bash and console blocks
is given to the real command-line parser (not run), so a renamed option or a form that does not
work fails here, not on a reader."""

from __future__ import annotations

import re
import shlex

import pytest
from data_helpers import REPO

from yamlformer.builder.cli import parser

READMES = [REPO / "README.md", REPO / "recipes" / "README.md", REPO / "specs" / "README.md"]
BLOCK = re.compile(r"^```(bash|console|sh)\n(.*?)^```", re.M | re.S)
#: shell words that end a command: what follows is another command or a redirection
ENDS = {"|", "||", "&&", ";", ">", ">>", "<", "&", "(", ")", "$("}


def commands(readme):
    """``(line number, argv)`` of each ``builder`` command in ``readme``'s shell blocks (a line
    continued with ``\\`` is joined; a command ends at ``|``, ``&&``, ``;`` or a redirection)."""
    text = readme.read_text()
    for block in BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(2)) + 1
        lines = block.group(2).replace("\\\n", " ").splitlines()
        for offset, line in enumerate(lines):
            if block.group(1) == "console":  # commands follow a prompt; the other lines are output
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = line.strip()
            if not line.startswith("builder ") and " builder " not in line:
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
            for i, word in enumerate(words):
                if (
                    word == "builder"
                    and (i == 0 or words[i - 1] in ENDS)
                    and not any("..." in w or w.startswith("[") for w in words)
                ):
                    end = next((j for j in range(i + 1, len(words)) if words[j] in ENDS), len(words))
                    yield first + offset, words[i:end]


CASES = [(f"{readme.relative_to(REPO)}:{n}", argv) for readme in READMES for n, argv in commands(readme)]


def test_the_readme_shows_the_users_path():
    shown = {argv[1] for _, argv in CASES if argv[0] == "builder" and len(argv) > 1}
    assert shown >= {"list", "describe", "cp", "validate", "train", "eval", "generate", "export-hf", "schema"}
    readme = (REPO / "README.md").read_text().splitlines()
    # the first lines: the command that installs and runs the default job, and the one that runs the tests
    assert "pip install -e ." in readme[3] and "builder train recipes/lm-stdlib.yaml" in readme[3]
    assert "python -m pytest" in readme[4]


@pytest.mark.parametrize("where,argv", CASES, ids=[where for where, _ in CASES])
def test_a_readme_command_parses(where, argv, capsys):
    words = argv[1:]
    if "--help" in words or "--version" in words or "--print-completion" in words:
        return  # they print and exit while parsing
    try:
        parser().parse_args(words)
    except SystemExit as stop:
        error = capsys.readouterr().err.strip()
        if re.search(r": no such file( or folder)?(\b|$)", error):
            return  # a file the example names: the form is right, the file is the reader's
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse: {error} ({stop.code})")
