"""What a run prints: a short header before its first step (the full estimate under --verbose),
rounded numbers, one line naming why it stopped, no Lightning chatter the run says itself."""

from __future__ import annotations

from recipe_helpers import tiny_recipe


def _before_training(out: str) -> list[str]:
    """The lines printed before the progress bar starts (Lightning's bar writes to stdout)."""
    lines = [line for line in out.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith(("Training:", "Epoch 0", "stopped: ")))
    return lines[:start]


def test_a_run_starts_with_a_short_header_and_ends_with_its_cause(tmp_path, capsys):
    from yamlformer.recipes.training.run import run

    run(tiny_recipe(tmp_path, trainer={"max_steps": 4}), samples=False)
    captured = capsys.readouterr()
    header = _before_training(captured.out)
    assert len(header) <= 6, header
    assert any(line.startswith("devices: cpu x 1, strategy auto: one device, precision 32") for line in header)
    model = next(line for line in header if line.startswith("model: tiny-decoder: "))
    assert "parameters" in model and "(= the built model)" in model and "FLOPs per training token" in model
    assert "--verbose" in model
    tail = captured.out.splitlines()
    stop = next(i for i, line in enumerate(tail) if line.startswith("stopped: "))
    assert tail[stop] == "stopped: trainer.max_steps 4 reached"
    val = tail[stop + 1]
    assert val.startswith("step 4: val loss ") and len(val.split("val loss ")[1].split(";")[0]) == 6  # 4 decimals
    for chatter in ("GPU available", "TPU available", "`Trainer.fit` stopped"):
        assert chatter not in captured.out + captured.err


def test_verbose_prints_the_estimate_tables_a_describe_prints(tmp_path, capsys):
    from yamlformer.recipes.training.run import run

    run(tiny_recipe(tmp_path, trainer={"max_steps": 2}), samples=False, verbose=True)
    header = _before_training(capsys.readouterr().out)
    assert len(header) > 20 and any("match" in line for line in header)


def test_a_resumed_run_s_progress_bar_keeps_its_total(tmp_path, capsys):
    from yamlformer.recipes.training.run import run

    path = tiny_recipe(
        tmp_path,
        trainer={"max_steps": 8, "log_every_n_steps": 2, "val_check_interval": 4, "output_dir": str(tmp_path / "run")},
    )
    run(path, {"trainer.max_steps": 4}, samples=False)
    capsys.readouterr()
    run(path, samples=False)
    out = capsys.readouterr().out
    assert "6/8 [" in out and "6/?" not in out  # before: "Training: 6/?" (no epoch start on resume)
    assert "train (resumed at step 4):" in out and "Epoch " not in out  # it said "Epoch 1" or "Epoch 0"


def test_a_resumed_run_s_bar_starts_at_its_step_and_rates_only_this_invocation(capsys):
    """The bar of a run resumed at step 12 of 24 starts at 12, and tqdm's rate counts from there
    (it counted the 12 restored steps as done in the first interval: a spike), across epochs."""
    from types import SimpleNamespace

    from yamlformer.recipes.training.callbacks import StepProgressBar

    trainer = SimpleNamespace(global_step=12, accumulate_grad_batches=2, max_steps=24, current_epoch=1)
    bar = StepProgressBar(refresh_rate=1)
    bar._trainer = trainer
    bar.get_metrics = lambda *args: {}
    bar.on_train_start(trainer, None)
    shown = bar.train_progress_bar
    assert (shown.n, shown.initial, shown.total) == (24, 24, 48) and shown.desc.startswith("train (resumed at step 12")
    bar.on_train_epoch_start(trainer)  # a new pass over the data: the count goes on
    trainer.global_step = 13
    bar.on_train_batch_end(trainer, None, None, None, batch_idx=5)  # the 2nd micro-batch of step 13
    assert shown.n == 26 and shown.format_dict["initial"] == 24 and "Epoch" not in shown.desc
    bar.on_train_end()
