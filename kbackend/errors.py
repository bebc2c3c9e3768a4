"""Errors kbackend raises for bad input. Each message is one line: what was wrong,
what was expected, what was received, and what to do."""


class KBackendError(ValueError):
    """Base class: a user-facing error the CLI prints as one line (exit status 2)."""


class BackendError(KBackendError):
    """The backend choice is invalid or conflicts with an already imported Keras."""


class DataError(KBackendError):
    """A dataset is missing, or its arrays are not valid for training."""


class ConfigError(KBackendError):
    """A training, model or optimizer option is invalid."""
