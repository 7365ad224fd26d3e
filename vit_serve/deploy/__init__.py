"""Running vit-serve on distributed engines (importing this package needs nothing):

- `ray`: the gateway as a Ray Serve application (the `ray` extra).
"""
