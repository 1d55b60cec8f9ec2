"""Typed errors a user can cause; the server turns them into HTTP responses in one place."""


class BurstServeError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelLoadError(BurstServeError):
    """The model directory or preset cannot be loaded (missing files, unsupported architecture)."""


class DeviceSpecError(BurstServeError):
    """A `devices` string is malformed or names devices that are not there."""


class PromptTooLongError(BurstServeError):
    """A prompt (plus the tokens asked for) does not fit in `max_model_len`."""


class InvalidRequestError(BurstServeError):
    """A request carries an invalid parameter (the `param` attribute names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(BurstServeError):
    """A worker process died or the engine was shut down; pending requests cannot finish."""


class ClusterError(BurstServeError):
    """The hosts could not form one engine: a host never joined, was refused, or the head is unreachable."""
