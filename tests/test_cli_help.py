"""Every option of every command says what it defaults to, every command's help prints, and the
shell completion scripts (shtab, from the same parser) complete commands, options and files."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from yamlformer.builder.cli import help_with_default, main, parser

#: root options that print something and exit: nothing to default
EXITS = {"--version", "--print-completion"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    root = parser()
    (sub,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    return {"": root, **sub.choices}


COMMANDS = _commands()


def _options(command: argparse.ArgumentParser):
    for action in command._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield action


@pytest.mark.parametrize("name", COMMANDS, ids=lambda n: n or "builder")
def test_every_option_states_its_default(name):
    command = COMMANDS[name]
    # argparse expands each help line with %-formatting: a stray % fails here, not on a user
    shown = "".join(command.format_help().split())  # (wrapping may break a line at a hyphen)
    missing = []
    for action in _options(command):
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"builder {name} {flag}: no help line"
        if not action.option_strings or set(action.option_strings) & EXITS:
            continue
        line = help_with_default(action) % {**vars(action), "prog": command.prog}
        if "default" not in line.lower() and "(required)" not in line:
            missing.append(flag)
        assert "".join(line.split()) in shown, f"builder {name} {flag}: its help is not what --help shows"
    assert not missing, f"builder {name}: options whose help does not say their default: {missing}"


def test_defaults_are_written_from_the_option_when_the_help_does_not_say_them(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--dry-run" in text and "(default: off)" in text  # a flag
    assert "--set KEY=VALUE" in text and "(default: none)" in text  # a repeatable option
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "GPUs in all (required)" in text and "(default: every mode)" in text


@pytest.mark.parametrize("name", [n for n in COMMANDS if n], ids=str)
def test_help_of_every_command_prints(name, capsys):
    with pytest.raises(SystemExit) as stop:
        main([name, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: builder {name}")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here to source the script in")
def test_bash_completion_completes_commands_options_and_files(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--print-completion", "bash"])
    assert stop.value.code == 0
    script = tmp_path / "builder.bash"
    script.write_text(capsys.readouterr().out)
    (tmp_path / "my-model.yaml").write_text("name: x\n")

    def complete(*words: str) -> list[str]:
        line = " ".join(words)
        probe = (
            f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
            f'_shtab_builder builder "{words[-1]}" "{words[-2]}"; printf "%s\\n" "${{COMPREPLY[@]}}"'
        )
        # the zoo names come from `builder list --names`: this interpreter's `builder` first on PATH
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        done = subprocess.run(
            ["bash", "-c", probe],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PATH=path),
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert complete("builder", "de") == ["describe"]
    assert set(complete("builder", "")) >= {name for name in COMMANDS if name}
    assert complete("builder", "describe", "--se") == ["--seq-len", "--set"]
    assert complete("builder", "validate", "my-") == ["my-model.yaml"]
    assert "llama3-8b" in complete("builder", "describe", "llama3-")  # zoo names where one is taken
    assert "lm-stdlib" in complete("builder", "train", "lm-")


def test_zsh_completion_names_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--print-completion", "zsh"])
    script = capsys.readouterr().out
    assert script.startswith("#compdef builder")
    for name in COMMANDS:
        assert not name or name in script


def test_a_checkout_never_installed_says_what_it_lacks(monkeypatch, capsys):
    """No distribution metadata, so no entry points: builder's own commands run, and the help and
    a missing command say to install the checkout."""
    import importlib.metadata

    from yamlformer.builder import packages

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: importlib.metadata.EntryPoints(()))
    monkeypatch.setattr(packages, "installed", lambda: False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "pip install -e ." in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as stop:
        main(["train", "lm-stdlib"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'train'" in err and "pip install -e ." in err
