"""A study's database shared by several sweep workers at once (a ``--print-slurm`` array job's
tasks, machines on one storage URL): each claims its own trial, and a worker busy elsewhere keeps
its running trials alive."""

from __future__ import annotations

import threading
import time

import pytest

optuna = pytest.importorskip("optuna")

from yamlformer.recipes.studies import runner, store


def test_workers_asking_at_once_never_claim_the_same_trial(tmp_path):
    """Several sweep workers (a --print-slurm array job's tasks) ask one SQLite study for a trial
    at the same moment: each gets its own waiting trial. SQLite has no SELECT ... FOR UPDATE, so
    before the storage began each transaction locked, two asks took one trial 4 times in 10."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    workers, rounds = 4, 3
    study = optuna.create_study(study_name="s", storage=store.storage_of(url))
    for n in range(workers * rounds):
        study.enqueue_trial({"lr": float(n)})
    studies = [optuna.load_study(study_name="s", storage=store.storage_of(url)) for _ in range(workers)]
    claimed: list[int] = []
    for _ in range(rounds):
        start = threading.Barrier(workers)

        def ask(study):
            start.wait()
            claimed.append(study.ask().number)

        threads = [threading.Thread(target=ask, args=(s,)) for s in studies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert len(claimed) == workers * rounds
    assert sorted(claimed) == list(range(workers * rounds)), claimed


def test_running_trials_stay_alive_while_the_loop_waits(tmp_path, monkeypatch):
    """A sweep's loop blocks for minutes on a finished trial's downstream evaluation; its running
    trials' heartbeats come from a thread of their own, so a worker starting meanwhile (an array
    task) does not fail them as stale."""
    monkeypatch.setattr(store, "HEARTBEAT", 0.3)
    monkeypatch.setattr(store, "GRACE", 1)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=store.storage_of(url))
    trial = study.ask()
    store.heartbeat(study, trial)
    sweep = runner.Sweep.__new__(runner.Sweep)
    sweep.study, sweep.running = study, [runner.Running(trial, None, None, tmp_path, 0.0, [])]
    done = threading.Event()
    beats = threading.Thread(target=sweep._beat, args=(done,))
    beats.start()
    time.sleep(2.5)  # the loop busy, past the grace period
    other = optuna.load_study(study_name="s", storage=store.storage_of(url))
    optuna.storages.fail_stale_trials(other)
    done.set()
    beats.join(5)
    assert other.trials[trial.number].state == optuna.trial.TrialState.RUNNING
