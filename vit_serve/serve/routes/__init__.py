"""The gateway's routes, one module each: classify, embed, explain, health, metrics, models, v2 (Open Inference
Protocol) and its repository extension, page."""
