"""ferry's exception classes. User mistakes and ferry's own bugs are different classes."""


class FerryError(Exception):
    """Base class of every error ferry raises on purpose."""


class CompileError(FerryError, ValueError):
    """The model, partitioner or configuration cannot be compiled as given."""


class ConfigError(CompileError):
    """A compile setting is invalid (a bad flag, alignment, algorithm or method name)."""


class UnsupportedByBackend(CompileError):
    """A backend cannot compile this partition; ferry's own `torch` backend runs it instead."""


class ProgramError(FerryError, ValueError):
    """A program file or Program object is malformed, truncated or from a newer format."""


class InputError(FerryError, ValueError):
    """A method was called with the wrong number, dtype, shape or device of inputs."""


class UnknownMethodError(FerryError, KeyError):
    """A method name the program does not have (a KeyError too, like a missing dict key)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AllocationError(FerryError, RuntimeError):
    """A device or host allocation failed; the message names the size and the device."""


class DeviceError(FerryError, RuntimeError):
    """A device is missing, unregistered or was used in the wrong direction."""


class DeviceIndexError(DeviceError, ValueError):
    """A device index that is invalid or does not exist on this machine."""


class BackendError(FerryError, RuntimeError):
    """A delegate backend is unknown or failed to initialise or execute."""


class InternalError(FerryError, AssertionError):
    """A ferry invariant broke: a bug in ferry, please report it."""


class PeerError(FerryError, RuntimeError):
    """Another rank of a distributed program died, hung past the timeout or failed; every
    rank gets this error instead of waiting forever. Restart all ranks."""
