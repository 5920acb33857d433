"""The commands the READMEs show parse: every `builder ...` line of their bash and console blocks
is given to the real command-line parser (not run), so a renamed option or a form that does not
work fails here, not on a reader."""

from __future__ import annotations

import re
import shlex

import pytest
from data_helpers import REPO

from yamlformer.builder.cli import main, parser

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


# -- the path from a Hugging Face model to training on your files, as the README shows it ---------------

SECTION = "### From a Hugging Face model to training on your files"


def _section() -> tuple[list[list[str]], str]:
    """The section's ``builder`` commands and its recipe (the YAML block)."""
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    body = text[start : text.index("\n## ", start)]
    shell = BLOCK.search(body).group(2)
    lines = [shlex.split(line, comments=True) for line in shell.splitlines() if line.startswith("builder ")]
    recipe = re.search(r"^```yaml\n(.*?)^```", body, re.M | re.S).group(1)
    return lines, recipe


def _hugging_face_folder(folder) -> str:
    """A tiny GPT-2 as a Hugging Face folder without a tokenizer; returns a byte-level BPE
    ``tokenizer.json`` that fits its vocabulary."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from yamlformer.builder.assemble import build_model
    from yamlformer.builder.hf import to_hf
    from yamlformer.builder.spec.loader import load_spec

    spec = load_spec(REPO / "specs" / "tiny" / "gpt2.yaml")
    torch.manual_seed(0)
    to_hf(spec, build_model(spec), folder)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(["def parse(x): return x"], trainers.BpeTrainer(vocab_size=250, initial_alphabet=alphabet))
    return bpe.to_str()


def test_the_readme_goes_from_a_hugging_face_model_to_training_on_your_files(tmp_path, monkeypatch, capsys):
    """README.md had no path from "I have a Hugging Face model" to "trained on my files" (a folder
    without a tokenizer warned, and model.init_from was only in recipes/README.md): its section's
    commands and recipe run as shown, the import without a tokenizer pointing at that section."""
    monkeypatch.chdir(tmp_path)
    commands, recipe = _section()
    assert [argv[:2] for argv in commands] == [
        ["builder", "import-hf"],
        ["builder", "generate"],
        ["builder", "train"],
        ["builder", "train"],
    ]
    tokenizer = _hugging_face_folder(tmp_path / "path" / "to" / "hf-model")
    (tmp_path / "my-files").mkdir()
    (tmp_path / "my-files" / "a.py").write_text("def parse(x):\n    return x + 1\n" * 50)
    (tmp_path / "finetune.yaml").write_text(recipe)

    assert main(commands[0][1:]) == 0  # import-hf: no tokenizer, and where to read what to do
    assert SECTION.removeprefix("### ") in capsys.readouterr().out
    (tmp_path / "path" / "to" / "hf-model" / "tokenizer.json").write_text(tokenizer)
    assert main([*commands[0][1:], "--overwrite"]) == 0
    assert "tokenizer: tokenizers" in capsys.readouterr().out
    assert main([*commands[1][1:], "--max-new-tokens", "3"]) == 0  # generate
    capsys.readouterr()
    dry_run = [*commands[2][1:], "--set", "data.seq_len=32"]  # the tiny model's window is 64 tokens
    assert main(dry_run) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "hf tokenizer from my-base" in out and "my-files (on disk)" in out and "(my-base's spec)" in out


@pytest.mark.slow
def test_the_readme_recipe_fine_tunes_the_imported_model(tmp_path, monkeypatch, capsys):
    """The section's last step: `builder train finetune.yaml` starts from the imported weights with
    their tokenizer and trains on the files (2 steps of the tiny model)."""
    monkeypatch.chdir(tmp_path)
    commands, recipe = _section()
    (tmp_path / "path" / "to").mkdir(parents=True)
    tokenizer = _hugging_face_folder(tmp_path / "path" / "to" / "hf-model")
    (tmp_path / "path" / "to" / "hf-model" / "tokenizer.json").write_text(tokenizer)
    (tmp_path / "my-files").mkdir()
    (tmp_path / "my-files" / "a.py").write_text("def parse(x):\n    return x + 1\n" * 200)
    (tmp_path / "finetune.yaml").write_text(recipe)
    assert main(commands[0][1:]) == 0
    tiny = ["data.seq_len=32", "data.batch_size=2", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    tiny += ["trainer.limit_val_batches=1", "trainer.accelerator=cpu", "trainer.precision=32", "sample.prompts=[]"]
    assert main([*commands[3][1:], *(f"--set={item}" for item in tiny)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "weights: " in out and "my-base" in out and "stopped: trainer.max_steps 2 reached" in out
