"""Each setting of `ServeSettings` by scope, as Triton keeps its server's options apart from a model's config:
the server's own (`SERVER_SETTINGS`: listeners, keys and TLS, repository control, backends, request bounds,
stores, telemetry), and the model defaults, which are exactly the keys a model's REPO/NAME/config.toml may set
(`vit_serve.runtime.model_config.KEYS`): a model without its own takes the server's.

Names only, flat (the flags', the VIT_SERVE_* variables' and the settings files'): the fields stay in their
Python groups (`settings.limits`, `settings.security`, ...), and `vit_serve.serve.settings` makes one typed model of
each side (`ServerSettings`, `ModelDefaults`) from these scopes. `vit-serve serve --help` lists its options by these
scopes; tests/serve/test_setting_scopes.py checks that every setting has exactly one.
"""

from __future__ import annotations

from enum import Enum

from vit_serve.runtime.model_config import KEYS


class Scope(Enum):
    """Where a setting applies; the value is its title in `vit-serve serve --help`."""

    LISTENERS = "listeners"
    SECURITY = "keys and TLS"
    REPOSITORY = "repository control"
    BACKENDS = "backends"
    BOUNDS = "request bounds"
    STORES = "stores"
    TELEMETRY = "telemetry"
    MODEL = "model defaults"


SERVER_SETTINGS: dict[Scope, tuple[str, ...]] = {
    Scope.LISTENERS: ("host", "port", "grpc_port", "metrics_port", "grpc_max_message_bytes",
                      "grpc_max_concurrent_calls", "root_path", "shutdown_drain_s", "shutdown_grace_s",
                      "header_timeout_s", "body_timeout_s", "max_connections"),
    Scope.SECURITY: ("api_keys", "api_keys_file", "admin_api_keys", "admin_api_keys_file", "default_key_priority",
                     "max_concurrent_per_key", "allow_any_key_admin", "open_probes", "open_weaviate", "image_url_hosts",
                     "image_url_networks", "image_url_max_bytes", "image_url_timeout_s", "cors_origins",
                     "ssl_certfile", "ssl_keyfile"),
    Scope.REPOSITORY: ("model", "model_name", "default_model", "model_control", "repository_poll_s",
                       "unload_grace_s", "load_models", "repository_api", "traffic", "shadow", "compare_window"),
    Scope.BACKENDS: ("backend", "openvino_cache_dir", "triton_url", "triton_timeout_s", "triton_startup_timeout_s",
                     "engine", "ingress_replicas", "decode_workers", "gpu_decode"),
    Scope.BOUNDS: ("max_body_bytes", "max_pixels", "max_patch_token_floats", "priority_levels", "max_labels",
                   "max_label_chars", "label_cache_size", "max_label_bytes", "max_label_prompts", "text_chunk_size",
                   "text_queue_size"),
    Scope.STORES: ("store", "store_size", "store_ttl_s", "store_password_file", "store_secret_file", "store_secret",
                   "sample_rate", "sample_flagged_rate", "sample_dir", "sample_max_bytes", "sample_retention_s",
                   "sample_redis_url", "sample_redis_stream", "sample_redis_password_file", "sample_redis_timeout_s",
                   "sample_redis_ttl_s"),
    Scope.TELEMETRY: ("request_ids", "otel", "drift_significance", "drift_min_window", "drift_refresh_s"),
}
_SCOPE = {name: scope for scope, names in SERVER_SETTINGS.items() for name in names}


def scope_of(name: str) -> Scope:
    """The scope of a setting by its flat name (KeyError: no such setting of the server)."""
    return Scope.MODEL if name in KEYS else _SCOPE[name]
