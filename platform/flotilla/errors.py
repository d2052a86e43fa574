"""The platform's exceptions.

Every exception here is picklable (it crosses Ray process boundaries: a worker raises
it, the driver reports it) and carries a message that names the input and the fix, with the
secrets of any URI it quotes masked (`flotilla.redact`): messages reach logs, MLflow tags and
`serve status`.

Each class carries the exit code that the `flotilla` command (and the scripts that call it)
ends with; `EXIT_CODES` is the table `flotilla --help` prints.
"""

from __future__ import annotations

from flotilla.redact import redact


# What each exit code means, for every subcommand.
EXIT_CODES = {
    0: "done",
    1: "the run failed while running (training, checkpoints, serving)",
    2: "bad input: the spec, the data, the tracking store, or an unknown model, version or alias",
    3: "the Ray cluster cannot hold what the spec asks for",
    130: "interrupted (Ctrl-C); the printed command resumes a training run",
}


class FlotillaError(Exception):
    """Base class: an error the user can act on; the `flotilla` command prints it without a traceback."""

    exit_code = 1

    def __init__(self, message: str):
        message = redact(message)
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class SpecError(FlotillaError):
    """The run spec is not well-formed; `problems` lists every problem found."""

    exit_code = 2

    def __init__(self, problems: list[str] | str, source: str = "run spec"):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = [redact(p) for p in problems]
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} is not well-formed, found the following errors:\n{lines}")

    def __reduce__(self):
        return (type(self), (self.problems, self.source))


class DataError(FlotillaError):
    """The input data cannot be read or does not match the spec."""

    exit_code = 2


class ModelError(FlotillaError):
    """The model cannot be built from the spec (bad factory path, wrong return type, ...)."""

    exit_code = 2


class CheckpointError(FlotillaError):
    """No usable checkpoint: the latest is torn and no complete earlier one exists."""


class ClusterError(FlotillaError):
    """The Ray cluster cannot run what the spec asks for."""

    exit_code = 3


class BundleError(FlotillaError):
    """An inference bundle is missing, incomplete, or fed rows it cannot use."""

    exit_code = 2


class TrainingError(FlotillaError):
    """Training failed on a worker for a reason that is not one of the above."""


class NotFiniteError(TrainingError):
    """The loss stopped being a number (NaN or infinite): the run stops, fails and registers nothing."""


class TrackingError(FlotillaError):
    """The MLflow tracking store or model registry cannot be used as configured."""

    exit_code = 2


class ServeError(FlotillaError):
    """A model cannot be deployed or served as asked (unknown alias, wrong model kind, ...)."""

    exit_code = 2


def summarize(error: BaseException, limit: int = 500) -> str:
    """One line for a log or an error message: a FlotillaError's own message, else the type and
    the last non-empty line of the text (where Ray and MLflow put the actual cause)."""
    if isinstance(error, FlotillaError):
        return error.message
    lines = [line.strip() for line in str(error).strip().splitlines()
             if line.strip() and not line.strip().startswith("(Background on this error")]  # SQLAlchemy's link
    text = f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__
    return text[:limit]
