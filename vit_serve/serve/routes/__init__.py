"""The gateway's routes, one module each (thin: their query and their schema):

- `classify`: POST /classify.
- `embed`: POST /embed.
- `explain`: GET and POST /explain (the rollout as a PNG at a display size, or as JSON).
- `image_request`: what the image routes share (their errors, links and deadline).
- `health`: GET /healthz and /readyz.
- `metrics`: GET /metrics.
- `models`: GET /models (with what /explain answers for each version), its compare and drift.
- `page`: GET /, the web page.
- `v2`: the Open Inference Protocol under /v2.
- `repository`: its model repository extension.
- `openai`: OpenAI's embeddings API, POST /v1/embeddings and GET /v1/models.
- `weaviate`: Weaviate's multi2vec inference contract under /weaviate/ (/vectorize, /meta, /.well-known/ready|live).
"""
