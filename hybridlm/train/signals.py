"""SIGINT and SIGTERM during training: finish the step, save, exit 130 / 143; a second signal ends it at once.

Non-standard here: the handler only records the signal; the training loop looks at it between steps
(`hybridlm.train.trainer.Trainer.should_stop`), so a step is never cut in half and the checkpoint it writes is one
an uninterrupted run would also have reached. A second signal, when the first one's save is too slow for the person
or the cluster, ends the process with `os._exit` there and then: checkpoints are written atomically, so at worst
the save under way is lost, and the run folder's lock goes with the process. A repeat within `REPEAT_S` of the first
is the same request, not a second one: a cluster's scheduler signals every process of a job, and torchrun passes
the signal it got on to its workers, so each worker may get one stop twice.
"""

from __future__ import annotations

import os
import signal
import threading
import time

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 1.0  # a signal this soon after the first one is the same request


def exit_code(signum: int) -> int:
    """The shell's status of a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


class StopSignals:
    """A context that catches SIGINT and SIGTERM: `signum` is the first one received (0: none yet)."""

    def __init__(self) -> None:
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python's rule for installing handlers
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum and time.monotonic() - self._first_at < REPEAT_S:
            return
        if self.signum:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without a checkpoint of this step\n"
                     .encode())
            os._exit(exit_code(signum))
        self.signum, self._first_at = signum, time.monotonic()
