"""Running vit-serve on distributed engines: `vit_serve.deploy.ray`, the gateway as a Ray Serve application
(needs the `ray` extra; importing this package needs nothing)."""
