"""The tiny DeepSeek checkpoint (`pegainfer-tiny deepseek`) loads, generates offline, and is
served end to end."""

from tests.tiny_line import check_tiny_checkpoint_generates_and_serves


def test_tiny_checkpoint_generates_and_serves(tmp_path):
    check_tiny_checkpoint_generates_and_serves(tmp_path, "deepseek")
