"""What serving a model needs, with no web framework in it: the backends, discovery and version policy, decode,
postprocessing and the Task. `vit_serve.serve` (HTTP, gRPC), `vit_serve.predict` and `vit_serve.deploy` build on it."""
