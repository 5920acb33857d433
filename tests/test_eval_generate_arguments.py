"""`builder eval` and `builder generate` refuse every bad option in one line that names it and
what it takes, before loading anything heavy; options the checkpoint's task would ignore are
refused, not ignored.

Exit status 2: the option is outside its own range (argparse's usage error, one line). Exit
status 1: the option is refused in light of the checkpoint (beyond its max_seq_len, another
task's option, options of two decoding modes).
"""

from __future__ import annotations

import pytest
import torch
from hostile_helpers import checkpoint, cli, refused  # noqa: F401  (checkpoint: a fixture)

PROMPT = ["--prompt", "def "]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--max-batches", "0"], ["argument --max-batches", "an integer from 1 up", "'0'"]),
        (["--batch-size", "-1"], ["argument --batch-size", "an integer from 1 to"]),
        (["--batch-size", "1e9"], ["argument --batch-size", "'1e9'"]),
        (["--seq-len", "0"], ["argument --seq-len", "from 1 to 1,073,741,824"]),
        (["--seq-len", "9" * 5000], ["argument --seq-len", "an integer from 1"]),
        (["--device", "bogus"], ["argument --device", "cpu, cuda, cuda:N or mps", "'bogus'"]),
        (["--device", "cuda:99999"], ["argument --device", "cpu, cuda, cuda:N or mps"]),
        (["--num-beams", "0"], ["argument --num-beams", "from 1 to 1,024"]),
        (["--length-penalty", "nan"], ["argument --length-penalty", "a finite number in [-100, 100]"]),
        (["--max-sentences", "-3"], ["argument --max-sentences", "from 1 up"]),
        (["--src", "no-such-file.de"], ["argument --src", "no-such-file.de: no such file"]),
        (["--data", "no-such-folder"], ["argument --data", "no such file or folder"]),
        (["--output", "no-such-folder/out.txt"], ["argument --output", "the folder no-such-folder does not exist"]),
    ],
)
def test_eval_option_out_of_range(capsys, tmp_path, argv, needles):
    refused(cli(capsys, "eval", tmp_path / "any.ckpt", *argv), 2, "builder eval: error:", *needles)


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--temperature", "nan"], ["argument --temperature", "a finite number in [0, 1,000,000]", "'nan'"]),
        (["--temperature", "inf"], ["argument --temperature", "finite"]),
        (["--temperature", "-0.5"], ["argument --temperature", "[0, 1,000,000]"]),
        (["--num-beams", "0"], ["argument --num-beams", "from 1 to 1,024"]),
        (["--max-new-tokens", "-1"], ["argument --max-new-tokens", "from 1 to"]),
        (["--max-new-tokens", "0"], ["argument --max-new-tokens", "from 1 to"]),
        (["--top-p", "2"], ["argument --top-p", "a finite number in (0, 1]"]),
        (["--top-p", "0"], ["argument --top-p", "(0, 1]"]),
        (["--top-k", "0"], ["argument --top-k", "from 1 to"]),
        (["--seed", "-1"], ["argument --seed", "from 0 to"]),
        (["--device", "bogus"], ["argument --device", "cpu, cuda, cuda:N or mps"]),
        (["--device", "cpu:3"], ["argument --device", "cpu, cuda, cuda:N or mps"]),
    ],
)
def test_generate_option_out_of_range(capsys, tmp_path, argv, needles):
    refused(cli(capsys, "generate", tmp_path / "any.ckpt", *PROMPT, *argv), 2, "builder generate: error:", *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_cuda_without_cuda_is_refused_before_loading(capsys, tmp_path, command):
    extra = PROMPT if command == "generate" else []
    refused(
        cli(capsys, command, tmp_path / "any.ckpt", *extra, "--device", "cuda"),
        2,
        "argument --device",
        "CUDA is not available here",
        "--device cpu",
    )


def test_missing_prompt_is_a_usage_error(capsys, tmp_path):
    refused(cli(capsys, "generate", tmp_path / "any.ckpt"), 2, "the following arguments are required: --prompt")


def test_eval_seq_len_beyond_the_model(capsys, checkpoint):
    refused(
        cli(capsys, "eval", checkpoint, "--seq-len", "33"), 1, "--seq-len 33: more than the model's max_seq_len (32)"
    )


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--num-beams", "2"], "--num-beams"),
        (["--max-sentences", "3"], "--max-sentences"),
        (["--split", "test"], "--split"),
        (["--length-penalty", "0.6"], "--length-penalty"),
    ],
)
def test_eval_refuses_another_tasks_option(capsys, checkpoint, argv, option):
    refused(
        cli(capsys, "eval", checkpoint, *argv),
        1,
        f"{option} applies to translation checkpoints",
        "checkpoint of task lm",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-beams", "2", "--top-k", "3"], "--top-k applies to sampling; beam search (--num-beams 2)"),
        (["--num-beams", "2", "--temperature", "0.7"], "--temperature applies to sampling; beam search"),
        (["--temperature", "0", "--seed", "1"], "--seed applies to sampling; --temperature 0 is greedy"),
        (["--temperature", "0", "--top-p", "0.9"], "--top-p applies to sampling; --temperature 0 is greedy"),
    ],
)
def test_generate_refuses_options_of_two_decoding_modes(capsys, checkpoint, argv, message):
    refused(cli(capsys, "generate", checkpoint, *PROMPT, *argv), 1, message)


def test_generate_empty_prompt(capsys, checkpoint):
    result = cli(capsys, "generate", checkpoint, "--prompt", "", "--max-new-tokens", "2")
    refused(result, 1, "give a non-empty --prompt")
    assert result.err.startswith("builder generate: ") and result.out == ""  # no empty line before it


def test_an_error_after_the_prompt_is_written_ends_its_line_on_stdout(capsys, checkpoint):
    result = cli(capsys, "generate", checkpoint, "--prompt", "caf\u00e9", "--max-new-tokens", "2")
    refused(result, 1)
    assert result.out == "caf\u00e9\n" and result.err.startswith("builder generate: ")


@pytest.mark.parametrize(
    "path, message",
    [
        ("missing.ckpt", "no checkpoint at"),
        (".", "is a folder"),
    ],
)
def test_a_missing_checkpoint_or_a_folder(capsys, tmp_path, path, message):
    target = tmp_path / path
    refused(cli(capsys, "eval", target), 1, message)


def test_valid_options_run(capsys, checkpoint, tmp_path):
    text = tmp_path / "val.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    result = cli(
        capsys,
        "eval",
        checkpoint,
        "--data",
        text,
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--max-batches",
        "1",
        "--device",
        "cpu",
        "--json",
    )
    assert result.status == 0, result.text
    result = cli(
        capsys,
        "generate",
        checkpoint,
        "--prompt",
        "x" * 40,
        "--max-new-tokens",
        "3",
        "--top-k",
        "5",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--device",
        "cpu",
    )  # a prompt longer than max_seq_len
    assert result.status == 0, result.text
    assert result.out.startswith("x" * 40)
