"""A completion's text as its tokens arrive: decoded in pieces, cut at the first stop string.

Text that could be the start of a stop string is held back until the next tokens show whether
it is, so that a stream never sends what the finished completion would not hold.
"""

from collections.abc import Sequence

from adaspec.models.tokenizer import Detokenizer


class CompletionText:
    def __init__(self, detokenizer: Detokenizer, stop_strings: Sequence[str]) -> None:
        self._detokenizer = detokenizer
        self._stops = tuple(stop_strings)
        self._held = ""
        self.text = ""
        """Everything sent so far."""
        self.num_tokens = 0
        """Tokens the text holds: with a stop string, those through the one that ended it."""
        self.stopped = False
        """A stop string ended the completion (it is left out of the text)."""

    def feed(self, token_ids: Sequence[int]) -> str:
        """The text to send for these tokens (empty once stopped)."""
        if self.stopped:
            return ""
        if not self._stops:
            self.num_tokens += len(token_ids)
            return self._send(self._detokenizer.feed(token_ids))
        out = []
        for token in token_ids:  # one at a time: the count ends at the stop's last token
            self.num_tokens += 1
            piece = self._detokenizer.feed((token,))
            # Were a stop string to end in text still held back (a character or byte run
            # not yet whole), the completion would end at this token: read it as it would.
            piece, stopped = self._take(piece, self._detokenizer.pending())
            out.append(piece)
            if stopped:
                break
        return "".join(out)

    def finish(self) -> str:
        """What is left to send once the tokens have ended."""
        if self.stopped:
            return ""
        piece, _ = self._take(self._detokenizer.flush())
        rest, self._held = self._held, ""
        return piece + self._send(rest)

    def _take(self, piece: str, pending: str = "") -> tuple[str, bool]:
        """The text to send once ``piece`` is added, and whether a stop string ended it
        (in ``piece`` or in ``pending``, the text the detokenizer still holds back)."""
        held = self._held + piece
        whole = held + pending
        cut = min((i for i in (whole.find(stop) for stop in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return self._send(whole[:cut]), True
        keep = self._prefix_of_a_stop(held)
        self._held = held[len(held) - keep:]
        return self._send(held[:len(held) - keep]), False

    def _prefix_of_a_stop(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - size:]):
                    longest = size
                    break
        return longest

    def _send(self, piece: str) -> str:
        self.text += piece
        return piece
