"""vLLM's tests/entrypoints/openai/models/test_models.py, for the base model (LoRA modules are
not served: README.md in this folder)."""

from __future__ import annotations

import openai
import pytest


def test_check_models(client, server):
    """test_check_models: the served model is listed, `root` its path."""
    models = client.models.list().data
    assert [model.id for model in models] == [server.model]
    assert models[0].model_extra["root"] == server.model


def test_retrieve_base_model(client, server):
    """test_retrieve_base_model: /v1/models/{id} answers the model."""
    model = client.models.retrieve(server.model)
    assert model.id == server.model
    assert model.model_extra["root"] == server.model


def test_retrieve_unknown_model(client):
    """test_retrieve_unknown_model: an unknown id is a 404 saying it does not exist."""
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("this-model-does-not-exist")
