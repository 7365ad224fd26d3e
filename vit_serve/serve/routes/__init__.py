"""The gateway's routes, one module each: classify, explain, health, metrics, v2 (Open Inference Protocol), page."""
