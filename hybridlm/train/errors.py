"""The exceptions of the trainer that end a run without a traceback: a user-facing error, and a stop on a signal."""


class TrainError(Exception):
    """Bad input or a setting that cannot work; `hybridlm train` prints the message and exits with status 2."""


class TrainInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after step `step` was saved; `hybridlm train` exits with 128 + signum."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"interrupted at step {step}; rerun the same command to continue")
        self.step, self.signum = step, signum
