"""File names given by flags: inputs opened only when they are regular files, outputs checked
before anything runs.

An input is opened without blocking and its kind read from the open descriptor: opening a
FIFO would otherwise wait for a writer forever, and a check by name before the open could be
raced. An input is read up to a bound, since some special files pass for regular ones and read
without end. A name the system refuses (longer than the file system allows, say) is a
``ConfigError`` naming the flag, never an ``OSError`` with a traceback; messages show the name
shortened, however long it is.
"""

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from adaspec.errors import ConfigError, show_value


def path_status(setting: str, path: str, *, follow: bool = True) -> os.stat_result | None:
    """The status of ``path`` (of a link itself unless ``follow``), None when nothing is
    there; a name that cannot be looked up at all is refused."""
    try:
        return os.stat(path, follow_symlinks=follow)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise ConfigError(setting, path, f"cannot be used as a file name "
                                         f"({error.strerror or type(error).__name__})") from None
    except ValueError:  # a NUL character, possible from the Python API only
        raise ConfigError(setting, path, "expected a file name without NUL characters") from None


class NotRegularFile(OSError):
    """The path names a FIFO, a device, a socket or a directory: reading one may wait for a
    writer forever or never end, so readers refuse it before reading a byte."""

    def __init__(self, kind: str) -> None:
        super().__init__(errno.EINVAL, f"a {kind}, not a regular file")
        self.kind = kind


_FILE_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
               (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
               (stat.S_ISSOCK, "socket"))
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_BAD_NAME = (errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL)
"""Errors that say the name itself cannot be looked up, whatever the file holds."""


def open_regular(path: str) -> BinaryIO:
    """Open a regular file for reading in binary mode; ``NotRegularFile`` for anything else,
    other ``OSError`` as ``open`` raises them."""
    # The kind is read from the open descriptor, so nothing can swap the file in between.
    try:
        descriptor = os.open(path, os.O_RDONLY | _NONBLOCK)
    except ValueError:  # a NUL character, possible from the Python API only
        raise OSError(errno.EINVAL, "a file name with a NUL character") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "special file")
            raise NotRegularFile(kind)
        if _NONBLOCK:
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(setting: str, path: str, kind: str, max_bytes: int) -> bytes:
    """The bytes of an existing regular file of ``kind`` ("JSON file", ...) of at most
    ``max_bytes``, or the refusal naming ``setting``: missing, a directory, anything else (a
    device or a pipe), unreadable, or longer."""
    try:
        with open_regular(path) as file:
            data = file.read(max_bytes + 1)
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(setting, path, f"expected an existing {kind}") from None
    except NotRegularFile as error:
        if error.kind == "directory":
            raise ConfigError(setting, path, f"expected a {kind}, got a directory") from None
        raise ConfigError(setting, path, f"expected a regular {kind}, got a "
                          f"{error.kind}") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        if error.errno in _BAD_NAME:
            raise ConfigError(setting, path, f"cannot be used as a file name ({reason})") \
                from None
        raise ConfigError(setting, path, f"cannot be read ({reason})") from None
    if len(data) > max_bytes:
        raise ConfigError(setting, path, f"expected a {kind} of at most "
                          f"{_size(max_bytes)}")
    return data


def _size(count: int) -> str:
    return f"{count // 2**20} MiB" if count >= 2**20 else f"{count} bytes"


SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("0", "false", "no", "off")
SWITCH_WORDS = SWITCH_ON + SWITCH_OFF
"""Values that read as a switch (``ADASPEC_TRACE`` takes them so), not as a file's name."""


def new_file(setting: str, path: str) -> None:
    """Refuse an output that could not be created: not a plain file path (unprintable, or
    naming a folder), existing already (a dangling link included, since creating the file
    would follow it), or in a directory that is missing or that this process cannot write.
    A switch word, ``-`` or ``~`` is refused too: a file of that name in the working folder
    is more likely a surprise than what was meant (``./off`` names one)."""
    if not path:
        raise ConfigError(setting, path, "expected a file name")
    if path.strip().lower() in (*SWITCH_WORDS, "-", "~"):
        raise ConfigError(setting, path, "expected a file path, not a switch, a stream or a "
                          f"home folder (./{path.strip()} names a file so)")
    if not path.isprintable() or os.path.basename(path) in ("", ".", ".."):
        raise ConfigError(setting, path, "expected a plain file path: printable, naming a "
                          "file rather than a folder")
    if path_status(setting, path, follow=False) is not None:
        raise ConfigError(setting, path,
                          "expected a file that does not exist yet; choose a new output file")
    folder = str(Path(path).parent)
    existing_directory(setting, path, folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(setting, path, f"expected a file in a writable directory; this "
                          f"process cannot create files in {show_value(folder)}")
    _probe_creation(setting, path)


def check_own_files(outputs: Sequence[tuple[str, str | None]]) -> None:
    """Each output (setting, path; None: not written) must be a file of its own: two names
    of one file (a link, ``./``) would have the second opened refused, or overwrite the
    first, once the start is over."""
    seen: dict[str, str] = {}
    for setting, path in outputs:
        if path is None:
            continue
        same = seen.setdefault(os.path.realpath(path), setting)
        if same != setting:
            raise ConfigError(setting, path, f"expected a file of its own; {same} names it too")


def _probe_creation(setting: str, path: str) -> None:
    """Create the file and remove it again: some directories (/proc, a read-only mount)
    pass the permission check and still refuse a new file, which would otherwise surface
    only once startup is over."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as error:
        raise ConfigError(setting, path, f"expected a file this process can create; "
                          f"{error.strerror or type(error).__name__}") from None
    os.close(descriptor)
    os.unlink(path)


def existing_directory(setting: str, given: str, folder: str | None = None) -> None:
    """Refuse unless ``folder`` (default: ``given`` itself) is an existing directory; the error
    shows the flag's value ``given``."""
    folder = given if folder is None else folder
    status = path_status(setting, folder)
    if status is None or not stat.S_ISDIR(status.st_mode):
        create = "" if folder == given else f"; create {show_value(folder)} first"
        raise ConfigError(setting, given, f"expected an existing directory{create}")
