"""Errors kbackend raises for bad input. Each message is one line: what was wrong,
what was expected, what was received, and what to do."""


class KBackendError(ValueError):
    """Base class: a user-facing error the CLI prints as one line (exit status 2)."""

    # The command line's exit status for this error (``kbackend.cli``'s documented statuses).
    exit_status = 2


class BackendError(KBackendError):
    """The backend choice is invalid or conflicts with an already imported Keras."""


class DataError(KBackendError):
    """A dataset is missing, or its arrays are not valid for training."""


class ConfigError(KBackendError):
    """A training, model or optimizer option is invalid."""


class JobError(KBackendError):
    """A multi-process job did not form (a process missing, a foreign program at the
    coordinator's address, a mismatched job) or lost a process. The CLI exits with status 3."""

    exit_status = 3


class Diverged(KBackendError):
    """Training diverged: a train loss (or the trained weights) became NaN or infinite.

    ``step`` is the first step whose loss was not finite. The CLI exits with status 4; nothing
    made of NaN (model, prediction cache entry) was written.
    """

    exit_status = 4

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
