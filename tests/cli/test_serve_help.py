"""`vit-serve serve --help` as a user reads it: at most 30 server options (the model defaults apart), the rarely used
flags hidden but still accepted, each with a deprecation warning naming its VIT_SERVE_* variable and --config key,
and --help-all listing everything."""

from __future__ import annotations

import re
import warnings

import pytest

from vit_serve.cli import build_parser, main
from vit_serve.cli.flags import FlagDeprecationWarning, argument, pydantic_fields, warn_hidden
from vit_serve.serve.config_file import serve_settings
from vit_serve.serve.settings import ServeSettings

HELP_COMMANDS = ("-h", "--help", "--help-all")
# Each hidden flag, a value for it, and the setting that value makes (tests/test_surface.py lists the same flags).
HIDDEN = {
    "grpc_max_message_bytes": (["--grpc-max-message-bytes", "4096"], 4096),
    "grpc_max_concurrent_calls": (["--grpc-max-concurrent-calls", "7"], 7),
    "shutdown_drain_s": (["--shutdown-drain-s", "1.5"], 1.5),
    "shutdown_grace_s": (["--shutdown-grace-s", "2.5"], 2.5),
    "admin_api_keys_file": (["--admin-api-keys-file", "/run/secrets/admin"], "/run/secrets/admin"),
    "open_probes": (["--no-open-probes"], False),
    "triton_timeout_s": (["--triton-timeout-s", "3"], 3.0),
    "triton_startup_timeout_s": (["--triton-startup-timeout-s", "4"], 4.0),
    "repository_poll_s": (["--repository-poll-s", "5"], 5.0),
    "unload_grace_s": (["--unload-grace-s", "6"], 6.0),
    "store_password_file": (["--store-password-file", "/run/secrets/redis"], "/run/secrets/redis"),
    "sample_redis_url": (["--sample-redis-url", "redis://cache:6379/0"], "redis://cache:6379/0"),
    "request_ids": (["--no-request-ids"], False),
    "image_url_networks": (["--image-url-network", "10.0.12.0/24"], ["10.0.12.0/24"]),
    "openvino_cache_dir": (["--openvino-cache-dir", "/var/cache/ov"], "/var/cache/ov"),
    "ingress_replicas": (["--ingress-replicas", "3"], 3),
}


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(["serve", *argv])
    assert done.value.code == 0
    return capsys.readouterr().out


def _options_by_group(text: str) -> dict[str, list[str]]:
    """The options (lines starting with a dash, two spaces in) of each group of a --help text, by its title."""
    groups: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            title = line[:-1]
            groups[title] = []
        elif title is not None and (m := re.match(r"^  (-[-\w]+)", line)):
            groups[title].append(m.group(1))
    return groups


def _setting(fields: dict, name: str):
    settings = serve_settings(None, fields)
    for group in (settings, settings.limits, settings.triton, settings.repository, settings.security,
                  settings.explain_store, settings.monitor, settings.ray):
        if name in type(group).model_fields:
            return getattr(group, name)
    raise KeyError(name)


def test_help_lists_at_most_30_server_options_beside_the_model_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    groups = _options_by_group(_help(capsys, "--help"))
    model = next(title for title in groups if title.startswith("model defaults"))
    server = {title: [o for o in opts if o not in HELP_COMMANDS] for title, opts in groups.items() if title != model}
    counts = {title: len(opts) for title, opts in server.items()}
    print(counts, "model defaults:", len(groups[model]))
    assert sum(counts.values()) <= 30, counts
    assert "--config" in server["options"] and "--max-batch" in groups[model]
    assert {"--replicas", "--max-replicas", "--replica-cpus", "--replica-gpus"} <= set(groups[model])  # per deployment
    shown = {o for opts in groups.values() for o in opts}
    assert not shown & {args[0] for args, _ in HIDDEN.values()}


def test_help_says_where_the_other_settings_are(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    text = " ".join(_help(capsys, "--help").split())
    assert f"{len(HIDDEN)} rarely used flags are not listed" in text
    assert "VIT_SERVE_<NAME> variable and a --config key" in text and "--help-all lists every option" in text


def test_help_all_lists_every_option(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    text = _help(capsys, "--help-all")
    listed = {o for opts in _options_by_group(text).values() for o in opts}
    every = {argument(f)[0][0] for f in pydantic_fields(ServeSettings.flat_fields()) if not f.flag.positional}
    assert every <= listed
    assert "--address" in listed
    assert "--grpc-max-message-bytes" not in _help(capsys, "--help")  # --help-all left --help as it was


def test_the_hidden_flags_are_the_listed_ones():
    assert {f.name for f in pydantic_fields(ServeSettings.flat_fields()) if f.flag.hidden} == set(HIDDEN)


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_a_hidden_flag_still_parses_sets_its_setting_and_warns(name, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(f"VIT_SERVE_{name.upper()}", raising=False)
    argv, value = HIDDEN[name]
    args = build_parser().parse_args(["serve", "m.safetensors", *argv])
    flags = {k: getattr(args, k, None) for k in ServeSettings.flat_fields()}
    assert _setting(flags, name) == value
    with pytest.warns(FlagDeprecationWarning) as caught:
        assert warn_hidden(args, pydantic_fields(ServeSettings.flat_fields()), "VIT_SERVE_") == [argv[0]]
    message = str(caught[0].message)
    env = str(value).lower() if isinstance(value, bool) else str(value)
    assert argv[0] in message and f"set VIT_SERVE_{name.upper()}={env}, or {name} = " in message
    assert message.endswith("in a --config file")
    # the command says it in one line on stderr, then goes on (here: to the missing model, the one error)
    assert main(["serve", str(tmp_path / "absent.safetensors"), *argv]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"vit-serve serve: warning: {message}"
    assert len(err) == 2 and "no such file" in err[1]


def test_a_listed_flag_does_not_warn(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlagDeprecationWarning)
        assert main(["serve", str(tmp_path / "absent.safetensors"), "--max-batch", "4", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "warning" not in err and "no such file" in err
