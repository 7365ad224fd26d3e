"""What serving a model needs, with no web framework in it: `load(LoadSpec(...))` gives a `Backend`, whose `ModelInfo`
says what it serves and which runs a `Task` on preprocessed batches into its `Outputs`. `vit_serve.serve` (HTTP,
gRPC), `vit_serve.predict` and `vit_serve.deploy` build on it; it imports none of them, nor a web or RPC framework.

Modules:

* `spec`: `LoadSpec` (one model to load), which backend it means and the checks made before loading.
* `backends/`: `load`, and one module per backend (torch, onnxruntime, openvino, tensorrt, triton, ray; each
  imported only when it is loaded) behind `backends.base` (`Backend`, `LocalBackend`, `RemoteBackend`, `ModelInfo`);
  `backends.sidecar` reads an export's manifest.
* `task`: `Task` (classify, explain, embed, grad_rollout) and `Outputs`.
* `discovery`: what a repository holds (`scan`), the version policy (`VersionPolicy`, `select_versions`).
* `model_config`: a model's own configuration (`ModelConfig`: limits, batching, instances, compute, decode,
  monitoring) from REPO/NAME/config.toml and its config.pbtxt, laid over the server's model defaults.
* `decode`: upload bytes -> the model input (one decode, the crop kept), and the PNG overlay (at a display size).
* `gpu_decode`: the same decode on CUDA (nvJPEG).
* `postprocess`: top-k classes, the rollout payload, embedding normalisation.
* `text_tower`: a text tower served beside an image model (request-time labels -> class embeddings, cached, on its
  own thread).
* `zero_shot`: request-time labels' limits and parsing, and their scores (the recipe is `vit_serve.zeroshot`).
* `errors`: what a request can be refused for (`ServingError` and its kinds); `vit_serve.serve.errors` maps them
  to HTTP and gRPC statuses.
* `scheduling/`: how a version's requests are queued, batched and run (`Ticket`, the pending queue, the cost
  model, the batching policy, instances and preemption, `BatchingRunner` / `DirectRunner`, `runner_for`), with
  an injected clock and an events protocol instead of metrics.
* `settings`: the runtime's settings groups (`RunnerLimits`, `TritonClientSettings`, `RepositorySettings`).
* `batch_curve`: what batching buys a backend (time per image at each batch size, measured at warm-up).
* `runtime_choice`: which runtime serves a model, chosen by measurement at load (the table, the chooser).
* `torch_forwards`: what a checkpoint's classify / embed can run on besides eager, and the choice among them.
* `accuracy_gate`: a reduced precision against fp32 on real photos at load (top-1 agreement, cosine), refused
  with the numbers when it misses its bounds unless forced.
* `payload_sampler`: an opt-in sample of what is served (Parquet parts or a Redis stream).
* `password_file`: a password read from a mounted file.
* `metrics`: the labels and buckets every model metric shares.
* `trace_context`: the trace context passed on to a model server.
"""

from vit_serve.runtime.backends import load
from vit_serve.runtime.backends.base import Backend, ModelInfo
from vit_serve.runtime.errors import (
    BackendUnavailableError,
    InvalidInputError,
    InvalidValueError,
    ModelTimeoutError,
    NotFoundError,
    NotReadyError,
    QueueFullError,
    ServingError,
    TooLargeError,
    UnreadableImageError,
    UnsupportedMediaError,
)
from vit_serve.runtime.spec import LoadSpec, check, resolve_backend
from vit_serve.runtime.task import Outputs, Task

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "InvalidInputError",
    "InvalidValueError",
    "LoadSpec",
    "ModelInfo",
    "ModelTimeoutError",
    "NotFoundError",
    "NotReadyError",
    "Outputs",
    "QueueFullError",
    "ServingError",
    "Task",
    "TooLargeError",
    "UnreadableImageError",
    "UnsupportedMediaError",
    "check",
    "load",
    "resolve_backend",
]
