"""`builder eval CKPT --tasks` through lm-evaluation-harness (recipes/tasks/lm/harness.py): a local task
definition and data file (nothing downloaded) scored on our model directly gives what lm-eval's own
Hugging Face model gives on the `builder export-hf` folder of the same checkpoint; the same as an
in-training callback; a task that does not exist is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from recipe_helpers import one_error_line, tiny_recipe

from yamlformer.builder.cli import main

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK = """\
task: stdlib_lines
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _lines() -> list[str]:
    from yamlformer.recipes.data.corpus import read_corpus
    from yamlformer.recipes.recipe.sections import DataSection

    text = read_corpus(DataSection(sources=["python-stdlib"], max_bytes=200_000), None).text
    return [line for line in text.splitlines() if 24 <= len(line.strip()) <= 60][2000:2040]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny sentencepiece LM trained a few steps, its export-hf folder and a local task: which
    of 4 line endings follows the line's start."""
    from yamlformer.recipes.training.run import run

    tmp = tmp_path_factory.mktemp("lm-eval")
    tokenizer = {"type": "sentencepiece", "model_type": "bpe", "vocab_size": 400}
    recipe = tiny_recipe(
        tmp,
        tokenizer=tokenizer,
        model={"overrides": {"max_seq_len": 128}},  # a context and its longest ending fit the window
        trainer={"max_steps": 16, "val_check_interval": 16},
    )
    summary = run(recipe, samples=False)
    assert main(["export-hf", summary["last"], "-o", str(tmp / "hf")]) == 0
    lines = _lines()
    with (tmp / "lines.jsonl").open("w") as f:
        for i, line in enumerate(lines):
            cut = len(line) // 2
            endings = [other[len(other) // 2 :] for other in (lines[(i + k * 7) % len(lines)] for k in range(4))]
            f.write(json.dumps({"context": line[:cut], "choices": endings, "label": 0}) + "\n")
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "stdlib_lines.yaml").write_text(TASK.format(data=tmp / "lines.jsonl"))
    return Path(summary["last"]), tmp / "hf", tasks


def test_builder_eval_tasks_matches_lm_evals_own_hf_model(trained, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    checkpoint, folder, tasks = trained
    assert main(["eval", str(checkpoint), "--tasks", "stdlib_lines", "--task-path", str(tasks), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["harness"]
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "device": "cpu", "dtype": "float32"},
        tasks=["stdlib_lines"],
        task_manager=TaskManager(include_path=str(tasks)),
        bootstrap_iters=0,
        log_samples=False,
    )["results"]["stdlib_lines"]
    assert ours["stdlib_lines/acc"] == pytest.approx(theirs["acc,none"], abs=1e-9)
    assert ours["stdlib_lines/acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-9)
    print(f"\nparity on {folder}: ours {ours}, lm-eval HFLM {theirs}")
    assert 0.25 < ours["stdlib_lines/acc"] <= 1.0  # above chance: the model has learnt something


def test_loglikelihoods_match_the_hf_model(trained):
    """Request by request, our log-likelihoods and greedy flags are lm-eval HFLM's."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from yamlformer.recipes.tasks.lm.harness import BuilderLM
    from yamlformer.recipes.trained import load_trained

    checkpoint, folder, _ = trained
    model, tokenizer, _ = load_trained(checkpoint, "cpu")
    lines = [line.strip() for line in _lines()[:12]]
    requests = [Instance("loglikelihood", {}, (line[:12], line[12:]), i) for i, line in enumerate(lines)] + [
        Instance("loglikelihood", {}, ("", "import os"), 99)
    ]
    ours = BuilderLM(model, tokenizer, batch_size=5).loglikelihood(requests, disable_tqdm=True)
    theirs = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=5).loglikelihood(
        requests, disable_tqdm=True
    )
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-3) and greedy_a == greedy_b


@pytest.mark.slow  # the did-you-mean indexes lm-eval's thousands of task files (~15 s)
def test_an_unknown_task_is_one_line(trained, capsys):
    checkpoint, _, tasks = trained
    assert main(["eval", str(checkpoint), "--tasks", "stdlib_line", "--task-path", str(tasks)]) == 1
    line = one_error_line(capsys.readouterr().err, "builder eval:")
    assert "no task 'stdlib_line'" in line and "did you mean 'stdlib_lines'?" in line


def test_the_harness_runs_every_n_steps_of_a_run(trained, tmp_path, capsys):
    """A recipe's ``harness:`` section scores its tasks every N steps (logged, printed); a resume may
    change the section (it decides what is measured, not what is learnt)."""
    import csv

    from yamlformer.recipes.training.run import run

    _, _, tasks = trained
    harness = {"tasks": ["stdlib_lines"], "every_n_steps": 4, "task_path": str(tasks), "limit": 8}
    recipe = tiny_recipe(tmp_path, harness=harness, trainer={"max_steps": 8, "val_check_interval": 8})
    summary = run(recipe, samples=False)
    out = capsys.readouterr().out
    printed = [line for line in out.splitlines() if line.startswith("harness at step")]
    assert [line.split(":")[0] for line in printed] == ["harness at step 4", "harness at step 8"]
    logged = {}
    for path in Path(summary["output_dir"]).rglob("*.csv"):
        for row in csv.DictReader(path.open()):
            if row.get("harness/stdlib_lines/acc"):
                logged[int(row["step"])] = float(row["harness/stdlib_lines/acc"])
    assert sorted(logged) == [4, 8] and all(0 <= v <= 1 for v in logged.values())
    longer = tiny_recipe(tmp_path, harness={**harness, "every_n_steps": 6}, trainer={"max_steps": 12})
    run(longer, samples=False)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("harness at step")]
    assert [line.split(":")[0] for line in printed] == ["harness at step 12"]


def test_a_recipe_harness_with_an_unknown_task_stops_before_the_first_step(trained, tmp_path, capsys):
    _, _, tasks = trained
    harness = {"tasks": ["stdlib_line"], "every_n_steps": 2, "task_path": str(tasks)}
    recipe = tiny_recipe(tmp_path, harness=harness)
    assert main(["train", str(recipe)]) == 1
    captured = capsys.readouterr()
    line = one_error_line(captured.err, "builder train:")
    assert "harness.tasks: no task 'stdlib_line'" in line
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


def test_a_bad_harness_section_is_located(tmp_path, capsys):
    recipe = tiny_recipe(tmp_path, harness={"tasks": ["x"], "every_n_steps": 0})
    assert main(["train", str(recipe), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{recipe}:" in err and "harness.every_n_steps: must be >= 1, got 0" in err
