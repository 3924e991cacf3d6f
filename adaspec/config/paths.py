"""File names given by flags, checked by their status before anything opens them.

Only ``stat`` is used here: opening a FIFO blocks until a writer comes, so a reader must know
it has a regular file first. A name the system refuses (longer than the file system allows,
say) is a ``ConfigError`` naming the flag, never an ``OSError`` with a traceback; messages show
the name shortened, however long it is.
"""

import os
import stat
from pathlib import Path

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


def regular_file(setting: str, path: str, kind: str) -> os.stat_result:
    """The status of an existing regular file of ``kind`` ("JSON file", ...), or the refusal:
    missing, a directory, or anything else (a device or a pipe, which would block a read)."""
    status = path_status(setting, path)
    if status is None:
        raise ConfigError(setting, path, f"expected an existing {kind}")
    if stat.S_ISDIR(status.st_mode):
        raise ConfigError(setting, path, f"expected a {kind}, got a directory")
    if not stat.S_ISREG(status.st_mode):
        raise ConfigError(setting, path, f"expected a regular {kind} (not a device or pipe)")
    return status


def new_file(setting: str, path: str) -> None:
    """Refuse an output that could not be created: not a plain file path (unprintable, or
    naming a folder), existing already (a dangling link included, since creating the file
    would follow it), or in a directory that is missing or that this process cannot write."""
    if not path:
        raise ConfigError(setting, path, "expected a file name")
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


def existing_directory(setting: str, given: str, folder: str | None = None) -> None:
    """Refuse unless ``folder`` (default: ``given`` itself) is an existing directory; the error
    shows the flag's value ``given``."""
    folder = given if folder is None else folder
    status = path_status(setting, folder)
    if status is None or not stat.S_ISDIR(status.st_mode):
        create = "" if folder == given else f"; create {show_value(folder)} first"
        raise ConfigError(setting, given, f"expected an existing directory{create}")
