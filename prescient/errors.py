"""Exceptions with messages that tell the user what to do."""

import signal


class PrescientError(Exception):
    """Base class of every error this project raises on purpose."""


class NotAMoEModelError(PrescientError):
    """The model holds no mixture-of-experts block that an adapter recognises."""


class UnsupportedModelError(PrescientError):
    """The model cannot be run this way (serving an encoder-decoder; CGOPipe on layers it cannot
    split into an attention half and an FFN half); the message says why."""


class ModelFilesError(PrescientError):
    """A model directory is missing, or one of its weight files is missing or corrupt."""


class DatasetError(PrescientError):
    """A dataset spec cannot be loaded, is empty, or lacks its text field."""


class TraceError(PrescientError):
    """A trace directory is missing, incomplete or corrupt."""


class FingerprintMismatchError(PrescientError):
    """An artifact was built for another model than the one it is used with."""

    def __init__(self, what: str, expected: "object", found: "object"):
        super().__init__(
            f"{what} was built for model {found} but is used with model {expected}; "
            "rebuild it from traces of this model."
        )
        self.expected = expected
        self.found = found


class CapacityError(PrescientError, ValueError):
    """A cache capacity or memory budget is unreadable, or too small to run at all."""


class OutputPathError(PrescientError):
    """An output path names something that cannot be written as a file (a directory, a FIFO...)."""


class OutputWriteError(PrescientError):
    """Writing an output failed (a full disk, a file-size limit, a read-only file system, a folder that
    cannot hold files); nothing half-written is left where the finished output belongs."""


class ServerSettingsError(PrescientError):
    """The server's settings cannot be used together: a TLS key without its certificate, or one that
    cannot be read; /metrics behind a key when no key is given."""


class StoppedBySignal(BaseException):
    """SIGINT or SIGTERM stopped the command. Raised in the main thread by the handlers `cli.main`
    installs, so every `finally` and `except BaseException` cleans up as for Ctrl-C; a BaseException
    (as KeyboardInterrupt is) so that `except Exception` does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
