"""The one exception type of the trainer: a user-facing message that says what to change."""


class TrainError(Exception):
    """Bad input or a setting that cannot work; `hybridlm train` prints the message and exits with status 2."""
