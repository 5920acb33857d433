"""A tracker behind :class:`Background`: the training thread's calls only append; the tracker's
thread sends what came in for ``gather_seconds`` at once, one step's ``log_metrics`` calls merged
into one; a tracker that fails is one warning; closing sends everything, waiting a bounded time."""

from __future__ import annotations

import threading
import time

from yamlformer.recipes.training.trackers import Background, merged


class Recorder:
    """A tracker that keeps each call with the time it came, taking ``seconds`` over each."""

    def __init__(self, seconds: float = 0.0, fail_on: str | None = None):
        self.calls: list[tuple[str, tuple, float]] = []
        self.seconds, self.fail_on = seconds, fail_on
        self.release = threading.Event()

    def _call(self, method: str, *args) -> None:
        if method == self.fail_on:
            raise ConnectionError("connection refused\nsecond line")
        time.sleep(self.seconds)
        self.calls.append((method, args, time.monotonic()))

    def log_steps(self, rows):
        self._call("log_steps", rows)

    def log_hyperparams(self, params):
        self._call("log_hyperparams", params)

    def finalize(self, status):
        self._call("finalize", status)


def _background(tracker, **kwargs) -> Background:
    return Background("fake", lambda: tracker, **kwargs)


def test_one_steps_calls_are_one_row_and_the_order_is_kept():
    calls = [
        ("log_hyperparams", ({"a": 1},)),
        ("log_metrics", ({"loss": 2.0, "epoch": 0}, 9)),
        ("log_metrics", ({"tok/s": 5.0, "epoch": 0}, 9)),
        ("log_metrics", ({"lr": 0.1, "loss": 3.0}, 9)),
        ("log_metrics", ({"loss": 1.0}, 19)),
        ("finalize", ("success",)),
        ("log_metrics", ({"val_loss": 4.0}, 19)),
    ]
    assert merged(calls) == [
        ("log_hyperparams", ({"a": 1},)),
        ("log_steps", ([({"loss": 3.0, "epoch": 0, "tok/s": 5.0, "lr": 0.1}, 9), ({"loss": 1.0}, 19)],)),  # later wins
        ("finalize", ("success",)),
        ("log_steps", ([({"val_loss": 4.0}, 19)],)),  # not across another call
    ]


def test_calls_are_gathered_merged_and_all_sent_at_close():
    tracker = Recorder()
    logger = _background(tracker, gather_seconds=0.5)
    logger.log_hyperparams({"x": 1})
    started = time.monotonic()
    for step in range(5):
        logger.log_metrics({"loss": float(step)}, step=step)
        logger.log_metrics({"lr": 0.1 * step}, step=step)
    time.sleep(1.5)  # one gathering round has sent them
    sent = [(method, args) for method, args, _ in tracker.calls]
    rows = [({"loss": float(s), "lr": 0.1 * s}, s) for s in range(5)]
    assert sent == [("log_hyperparams", ({"x": 1},)), ("log_steps", (rows,))]  # one call for the five steps
    # after the gathering time: not one wake-up for each call
    assert all(0.4 < at - started < 1.4 for _, _, at in tracker.calls), [at - started for *_, at in tracker.calls]
    logger.log_metrics({"loss": 9.0}, step=9)  # the last step, closed at once: not lost to the gathering
    logger.finalize("success")
    closing = time.monotonic()
    logger.close()
    assert time.monotonic() - closing < 0.4  # no gathering wait once closing
    assert [(m, a) for m, a, _ in tracker.calls[-2:]] == [
        ("log_steps", ([({"loss": 9.0}, 9)],)),
        ("finalize", ("success",)),
    ]
    logger.log_metrics({"loss": 10.0}, step=10)  # after the close: dropped, no error
    logger.close()  # twice: nothing more
    assert len(tracker.calls) == 4 and logger.failed is None


def test_a_slow_tracker_never_holds_the_training_thread():
    tracker = Recorder(seconds=0.5)
    logger = _background(tracker, gather_seconds=0.0)
    started = time.perf_counter()
    for step in range(20):
        logger.log_metrics({"loss": 1.0}, step=step)
    assert time.perf_counter() - started < 0.1  # 20 calls: 10 s of the tracker's time
    logger.close()  # all sent before it returns
    assert [step for method, args, _ in tracker.calls if method == "log_steps" for _, step in args[0]] == list(
        range(20)
    )


def test_a_failing_tracker_is_one_warning_and_its_calls_are_dropped(capsys):
    tracker = Recorder(fail_on="log_steps")
    logger = _background(tracker, gather_seconds=0.05)
    logger.log_hyperparams({"x": 1})
    for step in range(3):
        logger.log_metrics({"loss": 1.0}, step=step)
        time.sleep(0.15)  # each in a round of its own: the later ones are not tried
    logger.close()
    [warning] = capsys.readouterr().out.splitlines()
    assert warning.startswith("warning: fake: ConnectionError: connection refused; the run goes on without it"), warning
    assert [m for m, *_ in tracker.calls] == ["log_hyperparams"]  # the finalize after the failure: not sent


def test_a_tracker_that_hangs_at_close_is_left_after_the_bounded_wait(capsys):
    tracker = Recorder()
    tracker.finalize = lambda status: tracker.release.wait()  # a request that never returns
    logger = _background(tracker, flush_seconds=1.0, gather_seconds=0.0)
    started = time.monotonic()
    logger.close()
    assert 0.9 < time.monotonic() - started < 3.0
    assert "still sending after 1 s; the run ends without it" in capsys.readouterr().out
    assert logger.failed == "timed out"
    tracker.release.set()
