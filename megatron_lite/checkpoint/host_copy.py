"""Host copies of a rank's checkpoint state, taken without stalling training.

A save first copies the rank's weights and optimizer moments to host memory; training then goes
on while a thread writes the copies (``checkpoint.async_save``). The copies go into host buffers
that are kept from one save to the next (pinned where the device has pinned memory, so the copy
is a DMA that does not wait for the host), issued on a side stream of the accelerator. An event
recorded after the last copy makes the compute stream wait before it can change the tensors
copied (the next optimizer step), and the writer waits for it before reading the buffers: no
host synchronisation at the save itself. On the CPU there are no streams: the copies are plain
copies, done when ``copy`` returns.

Buffers are reused: a save must not start while the previous one's writer still reads them
(``Checkpointer.save`` refuses to).
"""

from __future__ import annotations

import torch


class HostCopies:
    def __init__(self, acc):
        """``acc``: DeepSpeed's accelerator (None: host tensors only, as in the tools)."""
        self.acc = acc
        # DeepSpeed's CPU accelerator has no streams or events (None).
        self.stream = acc.Stream() if acc is not None and acc.Stream is not None else None
        self.buffers: dict[tuple, torch.Tensor] = {}
        self._taken: set[tuple] = set()  # the keys copied in this save
        self._event = None

    def begin(self) -> None:
        """Before the first copy of a save: the side stream waits for the work queued so far
        (the step that produced the values)."""
        self._taken.clear()
        if self.stream is not None:
            self.stream.wait_stream(self.acc.current_stream())

    def copy(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (flattened, its dtype), in the buffer kept for ``key``."""
        if key in self._taken:  # a second tensor would overwrite the first one's copy
            raise ValueError(f"two tensors of one save were copied under the key {key}")
        self._taken.add(key)
        src = tensor.detach()
        buf = self.buffers.get(key)
        if buf is None or buf.numel() != src.numel() or buf.dtype != src.dtype:
            buf = torch.empty(src.numel(), dtype=src.dtype)
            buf = self.acc.pin_memory(buf) if self.acc is not None else buf
            self.buffers[key] = buf
        if self.stream is None or src.device.type == "cpu" or not src.is_contiguous():
            # (A strided view's flat form is a temporary the side stream could outlive: copied
            # here, at once; the state's tensors are contiguous.)
            buf.copy_(src.reshape(-1))
        else:
            with self.acc.stream(self.stream):
                buf.copy_(src.view(-1), non_blocking=True)
        return buf

    def end(self) -> None:
        """After the last copy: the compute stream waits for the copies before it changes what
        they read (the device waits, the host does not)."""
        if self.stream is not None:
            self._event = self.acc.Event()
            self._event.record(self.stream)
            self.acc.current_stream().wait_event(self._event)

    def wait(self) -> None:
        """Before the buffers are read (the writer thread): the copies are complete."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
