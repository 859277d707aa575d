"""The strict reader of the messages' bytes: :class:`Reader`, every read checked, each refusal a :class:`.SecureError`."""

from __future__ import annotations

import struct

from .errors import SecureError
from .params import SecureParams

__all__ = ["Reader"]


class Reader:
    """Reads one message's bytes front to back; ``what`` names the message in every error.

    Parameters
    ----------
    data : bytes
        The message.
    what : str
        Its name in errors (``"masked update"``, ``"unmask request"``, ``"reveal"``).
    params : SecureParams
        The round: every device id read must be one of its peers.
    """

    def __init__(self, data: bytes, what: str, params: SecureParams) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SecureError("length", f"{what}: expected bytes, got a {type(data).__name__}")
        self.data, self.what, self.params, self.pos = bytes(data), what, params, 0

    def fail(self, reason: str, message: str) -> SecureError:
        """A :class:`SecureError` whose message starts with the message's name."""
        return SecureError(reason, f"{self.what}: {message}")

    def take(self, k: int, field: str) -> bytes:
        """The next ``k`` bytes, ``field`` naming them if they are not all there."""
        left = len(self.data) - self.pos
        if k > left:
            raise self.fail("length", f"truncated: {field} needs {k} bytes at byte {self.pos}, {left} left")
        out = self.data[self.pos:self.pos + k]
        self.pos += k
        return out

    def u8(self, field: str) -> int:
        """One byte."""
        return self.take(1, field)[0]

    def u16(self, field: str) -> int:
        """A big-endian ``uint16``."""
        return struct.unpack(">H", self.take(2, field))[0]

    def u32(self, field: str) -> int:
        """A big-endian ``uint32``."""
        return struct.unpack(">I", self.take(4, field))[0]

    def kind(self, expected: int) -> None:
        """The kind byte, which must be ``expected``."""
        got = self.u8("the kind byte")
        if got != expected:
            raise self.fail("kind", f"kind byte {got}, expected {expected}")

    def device(self, field: str) -> str:
        """A device id (one length byte, UTF-8), which must be a peer of the round."""
        size = self.u8(f"the length of {field}")
        if size == 0:
            raise self.fail("peer", f"{field} is an empty id")
        raw = self.take(size, field)
        try:
            device = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("peer", f"{field} is not UTF-8") from None
        if not self.params.knows(device):
            raise self.fail("peer", f"{device!r} is not a peer of this round")
        return device

    def devices(self, field: str) -> tuple[str, ...]:
        """A ``uint16`` count, then that many distinct device ids."""
        count = self.u16(f"the count of {field}")
        out: list[str] = []
        for _ in range(count):
            out.append(self.once(self.device(f"an id of {field}"), out, field))
        return tuple(out)

    def once(self, device: str, seen, field: str) -> str:
        """``device``, refused if it is already in ``seen``."""
        if device in seen:
            raise self.fail("peer", f"{device!r} appears twice in {field}")
        return device

    def end(self) -> None:
        """Refuses bytes after the message's end."""
        left = len(self.data) - self.pos
        if left:
            raise self.fail("length", f"{left} trailing bytes after byte {self.pos}")
