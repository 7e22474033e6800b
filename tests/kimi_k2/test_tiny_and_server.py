"""The tiny Kimi-K2 checkpoint (`pegainfer-tiny kimi-k2`: Kimi's tiktoken tokenizer and chat
template) loads, generates offline, and is served end to end."""

from tests.tiny_line import check_tiny_checkpoint_generates_and_serves


def test_tiny_checkpoint_generates_and_serves(tmp_path):
    check_tiny_checkpoint_generates_and_serves(tmp_path, "kimi-k2")
