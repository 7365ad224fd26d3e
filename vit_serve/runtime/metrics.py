"""What the metrics of a model version share, wherever they are counted (the gateway's `vit_serve.serve.metrics`,
the Ray replicas' `runtime.backends.ray`): the labels that name a version and the buckets of the histograms."""

from __future__ import annotations

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
MODEL = ("model", "version")
