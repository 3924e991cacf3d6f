"""A file an observer writes (the event log, the state trace) that only watches the run: the
first write the system refuses (a full disk, a closed standard error) ends the output, never
the run, and is handed back at close."""

from typing import IO


class ObserverFile:
    """Text written to ``stream`` until a write fails; later writes are dropped. ``close``
    closes the stream when this owns it and returns the first failure (None: all written).
    A ``stream`` of None (a standard error the process started without) takes nothing."""

    def __init__(self, stream: IO[str] | None, *, owned: bool = True) -> None:
        self._stream: IO[str] | None = stream
        self._owned = owned
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        if self.failure is None and self._stream is not None:
            try:
                self._stream.write(text)
            except OSError as error:
                self.failure = error
        return len(text)

    def flush(self) -> None:
        if self.failure is None and self._stream is not None:
            try:
                self._stream.flush()
            except OSError as error:
                self.failure = error

    @property
    def closed(self) -> bool:
        return self._stream is None

    def close(self) -> OSError | None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close() if self._owned else stream.flush()
            except OSError as error:
                self.failure = self.failure or error
        failure, self.failure = self.failure, None
        return failure


def reason(error: OSError) -> str:
    """What the system said, for a one-line message."""
    return error.strerror or type(error).__name__
