"""The tiny GLM-5 checkpoint (`pegainfer-tiny glm5`) loads, generates offline past its
index_topk, and is served end to end."""

from tests.tiny_line import check_tiny_checkpoint_generates_and_serves

PROMPT = "Once upon a time there was a tiny model that attended to a few keys only"


def test_tiny_checkpoint_generates_and_serves(tmp_path):
    check_tiny_checkpoint_generates_and_serves(tmp_path, "glm5", PROMPT, max_tokens=24)
