"""The platform's exceptions.

Every exception here is picklable (it crosses Ray process boundaries: a worker raises
it, the driver reports it) and carries a message that names the input and the fix.
"""

from __future__ import annotations


class FlotillaError(Exception):
    """Base class: an error the user can act on; entry scripts print it without a traceback."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class SpecError(FlotillaError):
    """The run spec is not well-formed; `problems` lists every problem found."""

    def __init__(self, problems: list[str] | str, source: str = "run spec"):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} is not well-formed, found the following errors:\n{lines}")

    def __reduce__(self):
        return (type(self), (self.problems, self.source))


class DataError(FlotillaError):
    """The input data cannot be read or does not match the spec."""


class ModelError(FlotillaError):
    """The model cannot be built from the spec (bad factory path, wrong return type, ...)."""


class CheckpointError(FlotillaError):
    """No usable checkpoint: the latest is torn and no complete earlier one exists."""


class ClusterError(FlotillaError):
    """The Ray cluster cannot run what the spec asks for."""


class BundleError(FlotillaError):
    """An inference bundle is missing, incomplete, or fed rows it cannot use."""


class TrainingError(FlotillaError):
    """Training failed on a worker for a reason that is not one of the above."""


class TrackingError(FlotillaError):
    """The MLflow tracking store or model registry cannot be used as configured."""


class ServeError(FlotillaError):
    """A model cannot be deployed or served as asked (unknown alias, wrong model kind, ...)."""
