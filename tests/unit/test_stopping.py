"""cluster/run/stopping.py: SIGTERM/SIGINT ask for a stop at the step boundary, bounded by a grace period."""
import os
import signal
import time

import pytest

from cluster.run.stopping import Interrupted, StopSignals


def test_first_signal_asks_second_stops_at_once():
    stop = StopSignals(grace_s=60)
    stop.install()
    try:
        stop.armed = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.requested and stop.signum == signal.SIGTERM
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_the_grace_period_is_bounded_and_before_training_stops_at_once():
    stop = StopSignals(grace_s=0.3)
    stop.install()
    try:
        stop.armed = True
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(Interrupted) as e:
            while time.monotonic() - t0 < 10:  # a step that never reaches its boundary
                time.sleep(0.05)
        assert e.value.signum == signal.SIGTERM and time.monotonic() - t0 < 5
    finally:
        stop.restore()
    stop = StopSignals(grace_s=60)
    stop.install()
    try:
        with pytest.raises(Interrupted):  # not armed (still starting actors): nothing to checkpoint
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        stop.restore()
