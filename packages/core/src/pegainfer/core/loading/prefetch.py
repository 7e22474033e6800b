"""Reading a local checkpoint into the page cache while the engine process imports torch.

On a machine whose page cache does not hold the checkpoint (a first start, or one after the
kernel caches were restored onto a fresh machine), the weights are read from disk when they
load, after seconds of imports that barely use the disk. Asking the kernel to read the files
ahead (`posix_fadvise` WILLNEED, file by file, on a thread) overlaps the two; with the files
cached already it costs nothing. Torch-free: the engine process starts it before its imports.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def prefetch_checkpoint(model: str) -> threading.Thread | None:
    """Start reading `model`'s safetensors files ahead, if it is a local directory (a hub repo
    id resolves later, downloading); the thread returned ends once the reads are queued."""
    path = Path(model).expanduser()
    if not path.is_dir() or not hasattr(os, "posix_fadvise"):
        return None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    thread = threading.Thread(target=_read_ahead, args=(files,), name="pegainfer-prefetch",
                              daemon=True)  # fmt: skip
    thread.start()
    return thread


def _read_ahead(files: list[Path]) -> None:
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue  # the loader reports what it cannot read
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
