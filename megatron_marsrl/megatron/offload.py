"""Move a trainer's GPU memory to the host and back in place (time-shared colocation).

Megatron's parameters and `main_grad`s are views into contiguous buffers, and the optimizer
holds its fp32 copies and Adam moments as further tensors. `HostOffload` copies each tensor's
storage to host memory and shrinks the storage to zero bytes; `restore` re-grows it and copies
the bytes back. The storage objects stay the same, so every view (the parameters in their
buffers, the optimizer's references) is valid again afterwards without rebuilding anything -
the technique FSDP uses for its flat parameters. Storages that need no values back (gradient
buffers between steps, which the optimizer step left zeroed) are freed without a copy and come
back zero-filled.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


class HostOffload:
    """The storages of tensors moved to the host (or freed), restorable in place."""

    def __init__(self, *, include_cpu: bool = False):
        self.include_cpu = include_cpu
        """Also move storages that are already on the CPU (a copy within host memory: only to
        exercise the round trip where there is no GPU)."""
        self._held: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []

    def offload(self, tensors: Iterable[torch.Tensor], *, keep_values: bool = True) -> int:
        """Move (or, without ``keep_values``, free) the storages of ``tensors``; each storage
        once, however many tensors view it. Returns the bytes moved out."""
        seen = {storage.data_ptr() for storage, _, _ in self._held}
        moved = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size == 0 or storage.data_ptr() in seen or (tensor.device.type == "cpu" and not self.include_cpu):
                continue
            seen.add(storage.data_ptr())
            host = None
            if keep_values:
                host = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                host.copy_(_bytes(storage), non_blocking=True)
            self._held.append((storage, size, host))
            moved += size
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies are done before the storages shrink
        for storage, _, _ in self._held:
            if storage.nbytes():
                storage.resize_(0)
        return moved

    def restore(self) -> int:
        """Re-grow every storage moved out and copy its bytes back (zeros where none were
        kept). Returns the bytes restored."""
        restored = 0
        for storage, size, host in self._held:
            storage.resize_(size)
            target = _bytes(storage)
            if host is None:
                target.zero_()
            else:
                target.copy_(host, non_blocking=True)
            restored += size
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._held.clear()
        return restored


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
