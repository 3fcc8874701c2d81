"""The loop's decisions, made in one place (loop/milestones.Milestones): when an epoch ends (report, validation),
when a checkpoint is due, when the run stops. The training tests check what these decisions produce (resume equal
to an uninterrupted run, --stop_at_iter, --desired_acc); here each decision is checked against its rule on a small
schedule. A failure points to Milestones, or to a loop that no longer asks it."""
import os
import signal
from types import SimpleNamespace

import pytest

from lifecycle import signals
from loop.milestones import Milestones


def milestones(num_iters=20, steps_per_epoch=6, interval=5, stop_at_iter=None, desired_acc=None):
    """A run's Milestones (Milestones.of_run), its stop signals those of lifecycle/signals.py, as lifecycle/run.py's
    Run hands them in."""
    params = SimpleNamespace(num_iters=num_iters, checkpoint_interval=interval)
    args = SimpleNamespace(stop_at_iter=stop_at_iter, desired_acc=desired_acc)
    run = SimpleNamespace(params=params, args=args, stop_signal=signals.agreed_in_loop, settle=signals.settle)
    return Milestones.of_run(run, steps_per_epoch)


def test_epochs_end_at_whole_epochs_and_at_the_last_iteration():
    assert [i for i in range(1, 21) if milestones().epoch_ends(i)] == [6, 12, 18, 20]


def test_checkpoints_are_due_every_interval_and_never_with_interval_0():
    assert [i for i in range(1, 21) if milestones().checkpoint_due(i)] == [5, 10, 15, 20]
    assert not any(milestones(interval=0).checkpoint_due(i) for i in range(1, 21))


def test_the_run_stops_at_its_end_at_stop_at_iter_and_at_the_desired_accuracy(caplog):
    caplog.set_level("INFO")
    decide = milestones()
    assert [i for i in range(0, 25) if decide.stop(i)] == list(range(20, 25))
    decide = milestones(stop_at_iter=8)
    assert [i for i in range(0, 21) if decide.stop(i)][0] == 8
    assert "Stopped at iteration 8 (--stop_at_iter); starting again resumes here" in caplog.text
    reached, short = {"Accuracy/top1/valid": 0.5}, {"Accuracy/top1/valid": 0.4}
    assert milestones(desired_acc=0.5).stop(6, reached) and not milestones(desired_acc=0.5).stop(6, short)
    assert not milestones(desired_acc=0.5).stop(6, None)  # no validation at this iteration: go on


def test_a_run_resumed_at_its_stop_at_iter_says_there_is_nothing_to_train(caplog):
    caplog.set_level("INFO")
    assert milestones(stop_at_iter=8).stop(8)  # the first question, before any step
    assert "Nothing to train: the run is at iteration 8, --stop_at_iter 8" in caplog.text
    assert "starting again resumes here" not in caplog.text


def test_a_signal_stops_the_run_after_the_step_it_arrived_in(caplog):
    """A real signal to this process, recorded by lifecycle/signals.py's handler: the next question stops the run and
    names it. Twin: before the signal, and after the handlers are gone, the same question goes on."""
    caplog.set_level("INFO")
    decide = milestones()
    signals.install()
    try:
        assert not decide.stop(3)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert decide.stop(4) and signals.stopped_by() == "SIGUSR1"
        assert "stopped by SIGUSR1 at iteration 4; starting again resumes here" in caplog.text
    finally:
        signals.uninstall()
    signals.install()  # a new run forgets the old signal
    signals.uninstall()
    assert not milestones().stop(4) and signals.stopped_by() is None


@pytest.mark.parametrize("stop_at_iter", [25, 20])
def test_stop_at_iter_past_or_at_the_end_stops_at_the_end_without_the_stop_line(stop_at_iter, caplog):
    """Twin of the --stop_at_iter case: a run that ends normally does not say it was stopped."""
    caplog.set_level("INFO")
    assert [i for i in range(0, 21) if milestones(stop_at_iter=stop_at_iter).stop(i)] == [20]
    assert "Stopped at iteration" not in caplog.text
