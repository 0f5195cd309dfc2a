"""Model resolution: default GGUF converted once to a cached HF folder; clear errors otherwise."""

import pytest

from specmesh_server.model_loading import ModelNotFoundError, default_gguf_path, gguf_source, resolve_model_path


def test_missing_model_gets_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_default_model_resolves_to_a_converted_hf_folder_that_any_path_spec_accepts():
    path = resolve_model_path()
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    assert resolve_model_path(str(path)) == path


def test_the_default_models_folder_serves_its_gguf_and_another_folder_is_refused(tmp_path):
    """``--weights gguf`` over the folder ``specmesh bench`` names (the default model's conversion)."""
    assert gguf_source(str(resolve_model_path())) == gguf_source() == default_gguf_path()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="not one"):
        gguf_source(str(tmp_path))


@pytest.mark.slow
def test_a_local_hf_folder_loads_as_the_target(tmp_path, lm):
    from specmesh_server.model_loading import load_model

    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    other = load_model(str(tmp_path))
    assert other.name == tmp_path.name and other.model.config.vocab_size == lm.model.config.vocab_size
