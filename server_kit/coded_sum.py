"""Compressed updates decoded where the sums live: ``int8`` and ``int4`` bodies unpacked on the accumulator's device.

A compressed update crosses the bus as it came off the wire: an ``int4``
ResNet-18 update is 5.6 MB of nibbles and scales where its float32 weights
are 44.7 MB. :class:`CodedLayout` says where each tensor's codes and scales go
in one flat byte slot (codes first, then the float32 scales, 4-aligned), fills
a pinned host slot straight from the body's frames
(:func:`edge_sdk.compress.frames.frame_delta`: views of the body, nothing
decoded on the host) and decodes a device slot into the update's weights:

    codes -> q (int8 entries; int4 nibbles minus 8) -> q * scale (float32) -> base + that (float32)

the arithmetic of :func:`edge_sdk.compress.decode_delta` and
:func:`edge_sdk.compress.update_codec.with_delta`, one IEEE float32
multiplication and one addition per entry (never fused), so the weights are
bit for bit those of the host path on any device. The codes' values are
checked on the device (int8 -128; an int4 nibble 0, a padding nibble not 0):
the first bad entry's position joins the update's verdict, which
:class:`~server_kit.staging.StagedSum` reads at its one synchronisation.

torch is imported only when a layout is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edge_sdk.compress import Method
from edge_sdk.compress.blocks import BLOCK
from edge_sdk.compress.frames import FRAMED_METHODS, Frame

if TYPE_CHECKING:
    import torch

__all__ = ["CodedLayout"]


class CodedLayout:
    """Where the floating tensors' codes and scales of one method lie in a flat byte slot, and their decoder.

    Parameters
    ----------
    names : sequence of str
        The floating tensors, in the accumulator's order.
    sizes : sequence of int
        Their entry counts.
    method : Method
        ``int8`` or ``int4``.
    device : torch.device
        Where :meth:`decode` runs.
    """

    def __init__(self, names: Sequence[str], sizes: Sequence[int], method: Method, device: torch.device) -> None:
        import torch

        self.method = Method(method)
        if self.method not in FRAMED_METHODS:
            raise ValueError(f"updates decoded on the device are int8 or int4, not {self.method.value}")
        self.names = tuple(names)
        self.sizes = [int(n) for n in sizes]
        int4 = self.method is Method.INT4
        code_bytes = [(n + 1) // 2 if int4 else n for n in self.sizes]
        n_scales = [-(-n // BLOCK) if int4 else 1 for n in self.sizes]
        self.code_at = np.concatenate([[0], np.cumsum(code_bytes, dtype=np.int64)]).astype(np.int64)
        codes_end = int(self.code_at[-1])
        self.scales_from = -(-codes_end // 4) * 4  # the scales start 4-aligned after the codes
        self.scale_at = np.concatenate([[0], np.cumsum(n_scales, dtype=np.int64)]).astype(np.int64)
        self.nbytes = self.scales_from + 4 * int(self.scale_at[-1])
        self.size = sum(self.sizes)
        self.device = device
        entry_at = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
        # each entry's scale: its tensor's first scale plus its block within the tensor
        scale_index = np.empty(self.size, dtype=np.int64)
        for t, n in enumerate(self.sizes):
            per = BLOCK if int4 else max(n, 1)
            scale_index[entry_at[t]:entry_at[t + 1]] = self.scale_at[t] + np.arange(n, dtype=np.int64) // per
        self._scale_index = torch.from_numpy(scale_index).to(device)
        self._nibble_index = self._pads = self._pad_last = None
        if int4:  # entry -> nibble in the slot's nibble stream; a tensor of odd size ends with a padding nibble
            nib = np.empty(self.size, dtype=np.int64)
            for t, n in enumerate(self.sizes):
                nib[entry_at[t]:entry_at[t + 1]] = 2 * self.code_at[t] + np.arange(n, dtype=np.int64)
            pads = [2 * int(self.code_at[t]) + n for t, n in enumerate(self.sizes) if n % 2]
            contiguous = bool(np.array_equal(nib, np.arange(self.size, dtype=np.int64)))
            self._nibble_index = None if contiguous else torch.from_numpy(nib).to(device)
            self._pads = torch.tensor(pads, dtype=torch.int64, device=device) if pads else None
            last = [int(entry_at[t + 1]) - 1 for t, n in enumerate(self.sizes) if n % 2]
            self._pad_last = torch.tensor(last, dtype=torch.int64, device=device) if last else None

    def fill(self, slot: np.ndarray, frames: Mapping[str, Frame]) -> None:
        """Copy each tensor's codes and scales from its frame (a view of the body) into the uint8 ``slot``."""
        scales = slot[self.scales_from:self.nbytes].view(np.float32)
        for t, name in enumerate(self.names):
            f = frames[name]
            lo, hi = int(self.code_at[t]), int(self.code_at[t + 1])
            np.copyto(slot[lo:hi], f.codes.view(np.uint8))
            np.copyto(scales[int(self.scale_at[t]):int(self.scale_at[t + 1])], f.scales)

    def decode(self, slot: torch.Tensor, base: torch.Tensor, out: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """``out = base + q * scale`` (float32, the host path's bits; ``out`` may be of a wider float dtype) from the
        device's uint8 ``slot``, the change times ``float32(factor)`` first when it is not 1; returns the first
        entry whose code is out of range, or -1 (a device scalar)."""
        import torch

        codes = slot[: int(self.code_at[-1])]
        scales = slot[self.scales_from:self.nbytes].view(torch.float32)
        if self.method is Method.INT8:
            q8 = codes.view(torch.int8)
            bad = q8 == -128
            q = q8.to(torch.float32)
        else:
            nib = torch.stack((codes & 0x0F, codes >> 4), dim=1).view(-1)
            e = nib[: self.size] if self._nibble_index is None else nib[self._nibble_index]
            bad = e == 0
            q = e.to(torch.float32).sub_(8)  # exact: small integers
        decoded = q.mul_(scales[self._scale_index])  # one float32 rounding, as numpy's multiply
        if factor != 1.0:  # a clipped update: one more float32 rounding, as frames.applied
            decoded.mul_(torch.tensor(np.float32(factor), device=decoded.device))
        if out.dtype == torch.float32:
            torch.add(base, decoded, out=out)  # one float32 rounding, as with_delta
        else:
            out.copy_(torch.add(base, decoded, out=decoded))
        first = torch.where(bad.any(), bad.view(torch.uint8).argmax(), -1)
        if self._pads is not None:  # a padding nibble not 0: the tensor's last entry is blamed
            pad_bad = nib[self._pads] != 0
            first = torch.where((first < 0) & pad_bad.any(), self._pad_last[pad_bad.view(torch.uint8).argmax()], first)
        return first
