"""Reading a local checkpoint ahead (`loading.prefetch`): a thread for a directory of
safetensors files, nothing for a repo id or a directory without weights."""

from __future__ import annotations

from pegainfer.core.loading.prefetch import prefetch_checkpoint


def test_a_local_checkpoint_is_read_ahead(tmp_path):
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    thread = prefetch_checkpoint(str(tmp_path))
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_nothing_to_read_ahead(tmp_path):
    assert prefetch_checkpoint("Qwen/Qwen3-4B") is None  # resolved (downloaded) later
    assert prefetch_checkpoint(str(tmp_path)) is None  # no weight files
