"""Graph passes users may run themselves."""

from ferry.aot.place import PropagateDevicePass

__all__ = ["PropagateDevicePass"]
