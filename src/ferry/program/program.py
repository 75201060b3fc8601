"""A compiled program as one object: methods, delegates and segments; saved and loaded as one file."""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from dataclasses import dataclass, field

from ferry.errors import ProgramError, UnknownMethodError
from ferry.program.format import byte_view, file_chunks, read_parts
from ferry.program.report import CopyReport, copy_report
from ferry.program.schema import Delegate, Method, MethodMeta
from ferry.program.validate import check_semantics, validate_program

__all__ = ["Program", "load_program", "program_to_bytes", "save_program"]


@dataclass
class Program:
    """A compiled program: methods, delegates, and byte segments (constants and payloads).

    Segments are bytes-like objects (bytes, or memoryviews into a mapped file). A payload that
    stores none reads those of the program holding it (`holder_segments`)."""

    methods: dict[str, Method]
    delegates: list[Delegate] = field(default_factory=list)
    segments: list = field(default_factory=list)
    holder_segments: bool = field(default=False, compare=False)

    def method(self, name: str) -> Method:
        try:
            return self.methods[name]
        except (KeyError, TypeError):
            raise UnknownMethodError(f"program has no method {name!r}; methods: {', '.join(self.methods) or 'none'}") from None

    def method_meta(self, name: str) -> MethodMeta:
        return MethodMeta(self.method(name))

    def save(self, path) -> None:
        save_program(self, path)

    def to_bytes(self) -> bytes:
        return program_to_bytes(self)

    def copy_report(self, method: str | None = None) -> CopyReport | dict[str, CopyReport]:
        return copy_report(self, method)


def _chunks(program: Program, with_segments: bool = True):
    validate_program(program)
    return file_chunks(program.methods.values(), program.delegates, program.segments if with_segments else [])


def program_to_bytes(program: Program, with_segments: bool = True) -> bytes:
    """The file image of `program` (validated first; ProgramError if it is malformed).
    `with_segments=False`: a payload whose segments are those of the program holding it (its
    weights, stored once for every method), to be loaded with `load_program(..., segments=)`."""
    return b"".join(_chunks(program, with_segments))


def save_program(program: Program, path) -> None:
    """Write `program` to `path`. The file is written next to `path` and renamed into place,
    so a program currently mapped from `path` stays intact."""
    path = os.fspath(path)
    chunks = _chunks(program)  # validate before touching the file system
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:  # say which path the caller asked for, not the temporary one
        raise type(e)(e.errno, f"cannot write {path!r}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read(view: memoryview, verify: bool = False, holder_segments=None) -> Program:
    methods, delegates, segments = read_parts(view, verify)
    shared = not segments and holder_segments is not None
    program = Program(methods=methods, delegates=delegates, segments=list(holder_segments) if shared else segments,
                      holder_segments=shared)
    check_semantics(program)
    return program


def load_program(source, verify: bool = False, segments=None) -> Program:
    """Load a program from a path (memory-mapped; segments are zero-copy memoryviews into the
    mapping, which stays open while any of them is alive) or from bytes / bytearray /
    memoryview. Raises ProgramError for anything malformed, truncated, too new or failing a
    checksum (the metadata and delegate payloads always; every segment, weights included,
    with `verify=True`); OSError for a file that cannot be opened. `segments`: for a payload
    that stores none of its own, the segment table of the program holding it."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if isinstance(source, bytes):
            view = memoryview(source)
        elif isinstance(source, memoryview) and source.readonly and source.c_contiguous:
            view = byte_view(source)
        else:  # caller-mutable memory: take a private copy
            view = memoryview(bytes(source))
        try:
            return _read(view, verify, segments)
        except ProgramError as e:
            raise ProgramError(f"ferry program ({view.nbytes} bytes): {e}") from None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_program expects a path or bytes, got {type(source).__name__}")
    path = os.fspath(source)
    # non-blocking: opening a named pipe must not wait for a writer; then refuse anything that is
    # not a regular file (a pipe, a device, a directory) before reading a byte
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ProgramError(f"ferry program {path!r}: not a regular file")
        if st.st_size == 0:
            raise ProgramError(f"ferry program {path!r}: the file is empty")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        return _read(view, verify)
    except ProgramError as e:
        err = ProgramError(f"ferry program {os.fsdecode(path)!r}: {e}")
    view.release()
    try:
        mm.close()
    except BufferError:  # a segment view is still referenced; the mapping closes with it
        pass
    raise err
