"""The loop's decisions, in one place (Milestones): when an epoch ends (report and validate), when a checkpoint is
due, and when the run stops. Nothing here knows which script calls it, nor where a stop signal comes from: the run
hands in the question to ask at each step boundary (lifecycle/run.py's Run.stop_signal: lifecycle/signals.py)."""
import logging


def _no_signal():
    return None


def _nothing():
    pass


class Milestones:
    """The loop's decisions: when an epoch ends (report and validate), when a checkpoint is due, and when to stop (the
    last iteration, --stop_at_iter, --desired_acc, a stop signal the ranks agreed on). `stop_signal()`: asked at
    every step boundary, the name of the signal to stop on ('SIGTERM', ...) or None, collective (every rank asks at
    every boundary); `settle()`: called once the loop stops (the agreements still in flight are read)."""

    def __init__(self, steps_per_epoch, num_iters, checkpoint_interval=0, stop_at_iter=None, desired_acc=None,
                 stop_signal=_no_signal, settle=_nothing):
        self.steps_per_epoch = steps_per_epoch
        self.num_iters = num_iters
        self.stop_iter = min(num_iters, stop_at_iter or num_iters)
        self.interval = checkpoint_interval
        self.desired_acc = desired_acc
        self.stop_signal, self.settle = stop_signal, settle
        self.first = True

    @classmethod
    def of_run(cls, run, steps_per_epoch):
        """A run's (lifecycle/run.py's Run): its config's length and checkpoint interval, its --stop_at_iter and
        --desired_acc, and its job's signal agreement (lifecycle/signals.py: on several ranks, AGREEMENT_LAG steps
        after the signal came, without a wait)."""
        return cls(steps_per_epoch, run.params.num_iters, run.params.checkpoint_interval, run.args.stop_at_iter,
                   run.args.desired_acc, stop_signal=run.stop_signal, settle=run.settle)

    def epoch_ends(self, iters):
        """The epoch's last iteration, or the run's (a shorter last epoch is reported too)."""
        return iters % self.steps_per_epoch == 0 or iters == self.num_iters

    def stop(self, iters, val_means=None):
        """True once the loop is to stop after `iters` iterations (saying why when the run is not done); asked once
        before the first step and after every step. Collective: the ranks agree on a signal any of them received."""
        stop = self._decide(iters, val_means, self.stop_signal())
        if stop:
            self.settle()  # every rank stops at this boundary: the agreements still in flight are read
        return stop

    def _decide(self, iters, val_means, signal_name):
        first, self.first = self.first, False
        if iters >= self.num_iters:
            return True
        if signal_name:
            logging.info(f"stopped by {signal_name} at iteration {iters}; starting again resumes here")
            return True
        if self.desired_acc is not None and val_means and val_means["Accuracy/top1/valid"] >= self.desired_acc:
            logging.info(f"Reached the desired validation accuracy {self.desired_acc} at iteration {iters}; stopping")
            return True
        if iters >= self.stop_iter:
            logging.info(f"Nothing to train: the run is at iteration {iters}, --stop_at_iter {self.stop_iter}" if first
                         else f"Stopped at iteration {iters} (--stop_at_iter); starting again resumes here")
            return True
        return False

    def checkpoint_due(self, iters):
        """Every checkpoint_interval iterations (0: only when the run stops)."""
        return bool(self.interval) and iters % self.interval == 0
