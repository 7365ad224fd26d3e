"""`ServeSettings` as the pair a pydantic-settings user expects: `ServerSettings` (the server's scope) and
`ModelDefaults` (the keys of a model's config.toml), given as typed keywords or read back as views; the flat
keywords of before still work, with a DeprecationWarning naming the new place; the environment, a settings file
and the flags keep their precedence."""

from __future__ import annotations

import warnings

import pytest

from vit_serve.runtime.model_config import KEYS
from vit_serve.serve.config_file import serve_settings, settings_from_file
from vit_serve.serve.setting_scopes import SERVER_SETTINGS
from vit_serve.serve.settings import ModelDefaults, ServerSettings, ServeSettings


def _dump(s: ServeSettings) -> dict:
    return s.model_dump(exclude={"explain_store": {"store_secret"}})


def test_the_two_scopes_split_every_setting_but_the_model():
    assert set(ModelDefaults.model_fields) == set(KEYS)
    server = {n for names in SERVER_SETTINGS.values() for n in names} - {"model"}
    assert set(ServerSettings.model_fields) == server
    assert set(ServerSettings.model_fields) | set(ModelDefaults.model_fields) | {"model"} == set(
        ServeSettings.flat_fields())


def test_a_field_keeps_its_type_default_and_description():
    flat = ServeSettings.flat_fields()
    for cls in (ServerSettings, ModelDefaults):
        for name, info in cls.model_fields.items():
            assert info.description == flat[name].description, name
    assert ModelDefaults().max_batch == ServeSettings().limits.max_batch
    with pytest.raises(ValueError, match="max_batch"):
        ModelDefaults(max_batch=0)
    with pytest.raises(ValueError, match="port"):
        ServerSettings(port=70000)


def test_typed_and_flat_keywords_make_the_same_settings_and_only_flat_ones_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed = ServeSettings(model="m.onnx", server=ServerSettings(port=9001, api_keys=["k"], store_size=3),
                              model_defaults=ModelDefaults(max_batch=4, threads=2, replicas=2))
        of = ServeSettings.of({"port": 9001, "api_keys": ["k"], "store_size": 3, "max_batch": 4, "threads": 2,
                               "replicas": 2}, model="m.onnx")
    with pytest.warns(DeprecationWarning) as caught:
        flat = ServeSettings(model="m.onnx", port=9001, api_keys=["k"], store_size=3, max_batch=4, threads=2,
                             replicas=2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "server=ServerSettings(port=..., api_keys=..., store_size=...)" in message
    assert "model_defaults=ModelDefaults(max_batch=..., threads=..., replicas=...)" in message
    assert _dump(typed) == _dump(flat) == _dump(of)
    assert (typed.port, typed.limits.max_batch, typed.threads, typed.ray.replicas) == (9001, 4, 2, 2)


def test_the_views_read_back_and_round_trip():
    s = ServeSettings(model="m.onnx", server=ServerSettings(host="0.0.0.0", triton_url="t:1"),
                      model_defaults=ModelDefaults(max_delay_ms=1.5, version_policy="all", drift_window=40))
    assert (s.server.host, s.server.triton_url, s.server.store) == ("0.0.0.0", "t:1", "memory")
    assert (s.model_defaults.max_delay_ms, s.model_defaults.version_policy, s.model_defaults.drift_window) == (
        1.5, "all", 40)
    again = ServeSettings(model=s.model, server=s.server, model_defaults=s.model_defaults)
    assert _dump(again) == _dump(s)


def test_a_setting_under_the_wrong_scope_is_refused():
    with pytest.raises(ValueError, match="max_batch is not of ServerSettings"):
        ServeSettings(server={"max_batch": 4})
    with pytest.raises(ValueError, match="extra"):
        ModelDefaults(port=1)


def test_a_json_document_of_the_two_scopes_validates():
    s = ServeSettings.model_validate({"model": "m.onnx", "server": {"port": 9002},
                                      "model_defaults": {"max_queue": 9}})
    assert (s.port, s.limits.max_queue) == (9002, 9)


def test_keywords_over_the_environment_over_the_file_as_before(tmp_path, monkeypatch):
    file = tmp_path / "serve.toml"
    file.write_text('model = "m.onnx"\nmax_batch = 3\nmax_delay_ms = 7.0\nport = 9100\nthreads = 5\n')
    monkeypatch.setenv("VIT_SERVE_MAX_BATCH", "6")
    monkeypatch.setenv("VIT_SERVE_PORT", "9200")
    s = settings_from_file(file)
    assert (s.limits.max_batch, s.limits.max_delay_ms, s.port, s.threads) == (6, 7.0, 9200, 5)
    s = serve_settings(file, {"max_batch": 8, "port": None, "threads": 1})  # the flags (None: not given)
    assert (s.limits.max_batch, s.limits.max_delay_ms, s.port, s.threads) == (8, 7.0, 9200, 1)
    # a typed keyword is a keyword: over the variable; the fields not given leave the variable's and defaults
    s = ServeSettings(model_defaults=ModelDefaults(max_delay_ms=1.0))
    assert (s.limits.max_batch, s.limits.max_delay_ms, s.port) == (6, 1.0, 9200)
    s = ServeSettings(server=ServerSettings(port=9300), model_defaults=ModelDefaults(max_batch=2))
    assert (s.limits.max_batch, s.port) == (2, 9300)
