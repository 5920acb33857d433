"""The other commands' arguments (validate, describe, compare, diff, schema, plan, train, import-hf,
export-hf): each bad one is refused in one line naming it and what it takes, before heavy work.

Exit status 2 for a command line argparse refuses (an option outside its own range, an unknown
option or command), 1 for a value refused in light of the files (beyond a spec's max_seq_len).
"""

from __future__ import annotations

import pytest
from hostile_helpers import REPO, checkpoint, cli, refused  # noqa: F401  (checkpoint: a fixture)

SPEC = str(REPO / "specs" / "tiny" / "gpt2.yaml")
PLAN = ["--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", "64"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["describe", SPEC, "--seq-len", "0"], ["argument --seq-len", "an integer from 1 to 1,073,741,824", "'0'"]),
        (["describe", SPEC, "--seq-len", "2" * 40], ["argument --seq-len", "an integer from 1 to"]),
        (["describe", SPEC, "--batch", "-1"], ["argument --batch", "from 1 to 16,777,216"]),
        (["describe", SPEC, "--batch", "1e9"], ["argument --batch", "'1e9'"]),
        (["describe", SPEC, "--devices", "0"], ["argument --devices", "from 1 to"]),
        (["describe", SPEC, "--nodes", "10**9"], ["argument --nodes", "'10**9'"]),
        (["describe", SPEC, "--tensor-parallel", "0"], ["argument --tensor-parallel", "from 1 to 65,536"]),
        (["describe", SPEC, "--dtype", "bogus"], ["argument --dtype", "invalid choice: 'bogus'", "'bf16'"]),
        (["describe", SPEC, "--strategy", "zero3"], ["argument --strategy", "invalid choice"]),
        (["diff", SPEC, SPEC, "--src-len", "-5"], ["argument --src-len", "from 1 to"]),
        (["schema", "--indent", "1000000000"], ["argument --indent", "an integer from 0 to 16"]),
        (["schema", "--indent", "-1"], ["argument --indent", "from 0 to 16"]),
        (["plan", SPEC, *PLAN, "--hbm-bandwidth", "nan"], ["argument --hbm-bandwidth", "a finite number in (0, "]),
        (["plan", SPEC, *PLAN, "--inter-node-bandwidth", "0"], ["argument --inter-node-bandwidth", "(0, "]),
        (["plan", SPEC, *PLAN, "--headroom", "100"], ["argument --headroom", "[0, 100)"]),
        (["plan", SPEC, *PLAN, "--peak-tflops", "-1"], ["argument --peak-tflops", "(0, 1,000,000,000]"]),
        (["plan", SPEC, "--gpus", "0", "--gpu-memory", "80GiB", "--global-batch", "8"], ["argument --gpus"]),
        (
            ["plan", SPEC, "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", str(2**40)],
            ["argument --global-batch", "from 1 to 1,073,741,824"],
        ),
        (["plan", SPEC, *PLAN, "--gpus-per-node", "100000"], ["argument --gpus-per-node", "from 1 to 4,096"]),
        (["describe"], ["the following arguments are required: SPEC"]),
        (["describe", SPEC, "--no-such-option"], ["unrecognized arguments: --no-such-option"]),
        (["no-such-command"], ["argument COMMAND: invalid choice: 'no-such-command'"]),
    ],
)
def test_out_of_range_is_a_one_line_usage_error(capsys, argv, needles):
    prog = f"builder {argv[0]}" if argv[0] != "no-such-command" and "--no-such-option" not in argv else "builder"
    refused(cli(capsys, *argv), 2, f"{prog}: error:", *needles, "--help")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["describe", SPEC, "--seq-len", "65"], "--seq-len 65: more than tiny-gpt2's max_seq_len (64)"),
        (["describe", SPEC, "--src-len", "100"], "--src-len 100: more than tiny-gpt2's max_seq_len (64)"),
        (["diff", SPEC, SPEC, "--seq-len", "1000"], "--seq-len 1000: more than tiny-gpt2's max_seq_len (64)"),
        (["describe", SPEC, "--tensor-parallel", "2"], "--tensor-parallel needs --strategy fsdp"),
        (["plan", SPEC, *PLAN, "--seq-len", "65"], "--seq-len 65: more than tiny-gpt2's max_seq_len (64)"),
        (
            ["plan", SPEC, "--gpus", "4", "--nodes", "8", "--gpu-memory", "80GiB", "--global-batch", "8"],
            "--nodes 8: --gpus 4 is not a multiple of it",
        ),
        (
            ["plan", SPEC, "--gpus", "1000000", "--nodes", "1", "--gpu-memory", "80GiB", "--global-batch", "8"],
            "1,000,000 GPUs per node, more than 4,096",
        ),
        (["plan", SPEC, *PLAN, "--gpu", "v100"], "--gpu 'v100': unknown"),
    ],
)
def test_refused_in_light_of_the_spec(capsys, argv, message):
    refused(cli(capsys, *argv), 1, message)


def test_a_huge_global_batch_plans_at_once(capsys):
    """Micro-batches are the divisors of the global batch: found in sqrt steps, not by counting."""
    result = cli(capsys, "plan", SPEC, "--gpus", "8", "--gpu-memory", "80GiB", "--global-batch", str(2**30), "--json")
    assert result.status == 0, result.text


@pytest.mark.parametrize("command", ["validate", "describe", "compare", "train"])
def test_a_folder_or_missing_file_where_a_file_is_expected(capsys, tmp_path, command):
    for path, reason in ((tmp_path, "is a folder"), (tmp_path / "missing.yaml", "no such file")):
        lines = 2 if command == "validate" else 1  # validate adds its summary line
        err = refused(cli(capsys, command, path), 1, lines=lines) if command != "validate" else None
        if command == "validate":
            result = cli(capsys, command, path)
            assert result.status == 1 and reason in result.out, result.text
        else:
            assert reason in err, err


def test_diff_with_a_folder(capsys, tmp_path):
    refused(cli(capsys, "diff", SPEC, tmp_path), 1, "is a folder")


def test_train_resume_from_a_missing_checkpoint(capsys, tmp_path):
    from recipe_helpers import tiny_recipe

    recipe = tiny_recipe(tmp_path)
    refused(
        cli(capsys, "train", recipe, "--resume", tmp_path / "missing.ckpt"),
        2,
        "argument --resume",
        "missing.ckpt: no such file or folder",
    )


@pytest.mark.parametrize("command", ["export-hf", "import-hf"])
def test_an_output_folder_that_is_a_file(capsys, tmp_path, command, checkpoint):
    source = checkpoint if command == "export-hf" else tmp_path
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    refused(cli(capsys, command, source, "-o", a_file), 2, "argument -o/--out", "is a file, not a folder")
    refused(cli(capsys, command, source, "-o", a_file / "below"), 2, "argument -o/--out", "is a file, not a folder")


def test_export_options(capsys, tmp_path, checkpoint):
    refused(
        cli(capsys, "export-hf", SPEC, "-o", tmp_path / "out", "--weights", tmp_path / "missing.safetensors"),
        2,
        "argument --weights",
        "no such file",
    )
    deep = "[" * 5000 + "]" * 5000
    refused(
        cli(capsys, "export-hf", checkpoint, "-o", tmp_path / "out", "--hf-config", f"x={deep}"),
        1,
        "--hf-config x: the value is nested too deeply",
    )
    refused(
        cli(capsys, "export-hf", checkpoint, "-o", tmp_path / "out", "--hf-config", "novalue"),
        1,
        "--hf-config takes KEY=VALUE",
    )


def test_import_name_length(capsys, tmp_path):
    refused(
        cli(capsys, "import-hf", tmp_path, "-o", tmp_path / "out", "--name", "n" * 500),
        2,
        "argument --name",
        "at most 200 characters",
    )


@pytest.mark.parametrize(
    "item, message",
    [
        ("=", "expected --set dotted.key=value"),
        ("decoder..n_layers=2", "expected --set dotted.key=value"),
        ("extends=other.yaml", "extends is read from the file before --set applies"),
        ("decoder.n_layers=" + "[" * 2000 + "]" * 2000, "decoder.n_layers"),
    ],
)
def test_bad_set_values(capsys, item, message):
    refused(cli(capsys, "describe", SPEC, "--set", item), 1, message)


def test_a_plugin_that_does_not_exist(capsys):
    refused(
        cli(capsys, "describe", SPEC, "--plugin", "no_such_plugin_module"),
        1,
        "plugin 'no_such_plugin_module' not found",
    )


def test_an_internal_error_carries_its_message_in_one_short_line(capsys, monkeypatch):
    """The last-resort line says what went wrong (the exception's first line, cut short), never a
    traceback and never more than a line of whatever the message quoted."""
    import yamlformer.builder.cli.schema as schema
    from yamlformer.builder.cli import MESSAGE_CHARS, main

    def fails(message):
        def run(args):
            raise RuntimeError(message)

        return run

    monkeypatch.setattr(schema, "run", fails("the optimizer cannot clip\nline 2 of a file the user pointed at"))
    assert main(["schema"]) == 70
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("builder: internal error: RuntimeError in ")
    assert ": the optimizer cannot clip ...; please report it" in line and "line 2" not in line
    monkeypatch.setattr(schema, "run", fails("x" * 10_000))
    assert main(["schema"]) == 70
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "x" * MESSAGE_CHARS + " ..." in line and "x" * (MESSAGE_CHARS + 1) not in line
