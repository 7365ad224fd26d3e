"""Every setting of `ServeSettings` has one scope: the server's own (listeners, keys and TLS, ...) or a model
default, and the model defaults are exactly what a model's config.toml may set."""

from __future__ import annotations

from collections import Counter

import pytest

from vit_serve.cli.flags import pydantic_fields
from vit_serve.runtime.model_config import KEYS
from vit_serve.serve.setting_scopes import SERVER_SETTINGS, Scope, scope_of
from vit_serve.serve.settings import ServeSettings

SETTINGS = ServeSettings.flat_fields()


def test_each_setting_has_one_scope():
    listed = Counter(name for names in SERVER_SETTINGS.values() for name in names)
    assert [name for name, n in listed.items() if n > 1] == []
    assert set(listed) | set(KEYS) == set(SETTINGS)  # nothing left out, nothing that is no setting
    assert not set(listed) & set(KEYS)  # a model default is not the server's too
    assert Scope.MODEL not in SERVER_SETTINGS


def test_the_model_defaults_are_a_model_configs_keys():
    assert sorted(n for n in SETTINGS if scope_of(n) is Scope.MODEL) == sorted(KEYS)


@pytest.mark.parametrize(("name", "scope"), [("port", Scope.LISTENERS), ("ssl_keyfile", Scope.SECURITY),
                                             ("model_control", Scope.REPOSITORY), ("store", Scope.STORES),
                                             ("otel", Scope.TELEMETRY), ("max_batch", Scope.MODEL),
                                             ("triton_url", Scope.BACKENDS), ("max_pixels", Scope.BOUNDS)])
def test_scope_of(name, scope):
    assert scope_of(name) is scope


def test_a_flags_section_agrees_with_its_scope():
    """The flags listed as model defaults are the model-scoped ones; a backend's or a store's own group holds
    settings of that scope."""
    sections = {"model": Scope.MODEL, "triton": Scope.BACKENDS, "ray": Scope.BACKENDS, "store": Scope.STORES,
                "sampler": Scope.STORES}
    for field in pydantic_fields(SETTINGS):
        scope = scope_of(field.name)
        if field.flag.section is None:  # the server's own group
            assert scope is not Scope.MODEL, field.name
        else:
            assert scope is sections[field.flag.section], field.name


def test_an_unknown_name_has_no_scope():
    with pytest.raises(KeyError):
        scope_of("max_batches")
