"""The serving gateway (FastAPI, gRPC) over `vit_serve.runtime`: `create_app(settings)`, `ServeSettings`; run it
with `vit-serve serve REPO`. Backends, discovery, decode and postprocessing are the runtime's; this package is the
protocols, the live models and the policies around them.

The app:

- `settings`: `ServeSettings`, its groups, and its two scopes `ServerSettings` and `ModelDefaults`.
- `setting_scopes`: each setting's scope (the server's own, or a model default).
- `config_file`: `serve --config`.
- `app`: the factory, the lifespan, `run`.
- `gateway`: the running parts of one app.
- `shutdown`: drain, then stop.
- `slow_clients`: header and body deadlines, the connection cap.
- `metrics_listener`: the metrics port.

The models:

- `repository`: which versions are loaded; model control and polling.
- `version_loader`: builds a version (its thread, runner, decoder, text tower and monitor).
- `model_version`: one loaded version (its runner is `vit_serve.runtime.scheduling`'s).
- `version_state`: a version's phases and the one table of transitions between them.
- `version_decode`: a version's uploads (the decode pool or the GPU) and its contract's crops.
- `admission`: a request's scheduling `Ticket`, with the gateway's errors.
- `traffic`, `compare`: canaries, sticky sessions and the shadow (each model's `TrafficSplits`); live agreement
  with them.
- `monitoring`: OOD scores and drift of a version.
- `labels`: request-time zero-shot labels.

Requests:

- `pipeline`: one request: announce, read, choose the version once, decode, infer, answer (images from the
  image routes, tensors from /v2 and gRPC through the same steps).
- `answer_hooks`: what runs after an answer (Server-Timing, the payload sampler).
- `uploads`: the image out of a request.
- `deps`: the app's gateway, the version a request goes to.
- `hangup`: a client that left cancels its work.
- `middleware`: request ids, metrics, the 500 boundary, the body limit.
- `schemas`: response bodies, the strict JSON encoder.
- `errors`: runtime errors -> HTTP statuses and gRPC codes, in one table; the /v2 and /v1 envelopes.
- `tracing`, `metrics`: OpenTelemetry; Prometheus.

Callers:

- `keys`: hashed API keys, key files.
- `security`: the key check, admin keys, CORS.
- `caller`: a request's verified identity.
- `rate_limit`, `in_flight`: token buckets per key; requests in flight per key.

The Open Inference Protocol:

- `v2_protocol`: the KServe v2 wire format.
- `v2_model`: what HTTP /v2 and gRPC share: a model's metadata, what a request asks of a version, its outputs
  shaped from the answer.
- `grpc`: the gRPC service.

Embeddings for retrieval (OpenAI's embeddings API, Weaviate's multi2vec contract):

- `openai_schema`: its request, response and error bodies; a request's items (texts, data-URI images, URLs).
- `embeddings`: one embedding request (/v1/embeddings, Weaviate's /vectorize): texts through the text tower, images
  through the batcher, image URLs fetched where allowed.
- `image_urls`: image URLs fetched under the operator's allow-list, size cap and timeout (the SSRF guard).

Folders:

- `routes/`: the routes, thin (their query and their schema).
- `stores/`: where recent images live for GET /explain?id= (memory, Redis, the store secret, redaction).
- `static/`: the web page (`index.html`: upload, top-5, the overlay, the OOD flag, the model picker).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeSettings", "create_app"]


def __getattr__(name: str) -> Any:  # lazy: backends import this package without needing FastAPI loaded
    if name == "create_app":
        from vit_serve.serve.app import create_app

        return create_app
    if name == "ServeSettings":
        from vit_serve.serve.settings import ServeSettings

        return ServeSettings
    raise AttributeError(name)
