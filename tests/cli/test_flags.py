"""`vit-serve serve --help` by scope: at most 30 server options, then the model defaults (each one a key a model's
config.toml may set), the Triton backend, the explain store, the payload sampler and Ray Serve; one help text per
setting (the field's description, the flag says nothing else)."""

from __future__ import annotations

import argparse

from vit_serve.cli import build_parser
from vit_serve.cli.flags import pydantic_fields
from vit_serve.runtime.model_config import KEYS
from vit_serve.serve.settings import ServeSettings


def _serve() -> argparse.ArgumentParser:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _groups() -> dict[str, list[str]]:
    return {g.title.split(" (")[0]: [a.dest for a in g._group_actions] for g in _serve()._action_groups
            if g._group_actions}


def test_serve_help_lists_server_options_apart_from_the_model_defaults():
    groups = _groups()
    groups["server"] = [d for title, dests in groups.items() if title.startswith("server: ") for d in dests]
    hidden = {f.name for f in pydantic_fields(ServeSettings.flat_fields()) if f.flag.hidden}  # --help-all's only
    # REPO|MODEL is an argument, not an option
    assert len([d for d in groups["server"] if d != "model" and d not in hidden]) <= 30
    assert set(groups["model defaults"]) <= set(KEYS)  # a model's own config.toml can set each of them
    assert {"max_batch", "max_delay_ms", "max_queue", "instances", "threads", "compile", "torchscript", "tome",
            "decode", "monitoring"} <= set(groups["model defaults"])
    assert {"host", "port", "api_keys", "ssl_certfile", "otel", "model_control"} <= set(groups["server"])
    help_text = _serve().format_help()
    assert "model defaults (each model's own REPO/NAME/config.toml" in help_text


def test_each_flag_says_its_settings_description():
    """No second help text: a serve flag's help is its field's description (and the default it leaves)."""
    by_dest = {a.dest: a for a in _serve()._actions}
    for field in pydantic_fields(ServeSettings.flat_fields()):
        assert field.flag.help is None, field.name
        assert field.description, field.name
        shown = getattr(by_dest[field.name], "full_help", by_dest[field.name].help)  # a hidden flag's: --help-all's
        assert shown.replace("%%", "%").startswith(field.description), field.name


def test_serve_help_lists_the_server_options_by_scope():
    """Each server option under its scope's title (vit_serve.serve.setting_scopes), in the scopes' order."""
    from vit_serve.serve.setting_scopes import SERVER_SETTINGS, Scope, scope_of

    groups = {title.removeprefix("server: "): dests for title, dests in _groups().items()
              if title.startswith("server: ")}
    assert list(groups) == [s.value for s in SERVER_SETTINGS if s.value in groups]
    assert all(scope_of(d) is Scope(title) for title, dests in groups.items() for d in dests)
    assert {"host", "port", "grpc_port"} <= set(groups["listeners"])
    assert {"api_keys", "ssl_certfile"} <= set(groups["keys and TLS"])
