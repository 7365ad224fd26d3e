"""Writing an ONNX model to one file without serializing it whole in Python.

`onnx.save` calls protobuf's `SerializeToString` on the whole ModelProto: for a ViT-L (1.2 GB of weights) that
peaked 5 GB above the proto itself (the encoder's growing buffer, then the bytes object). `save_proto` writes the
same message field by field instead: everything but the graph's initializers serialized at once (a few MB), then
each initializer on its own (at most one weight matrix in memory). Protobuf parsers accept a message's fields in
any order and concatenate repeated fields, so `onnx.load` of the file gives a message equal to `proto`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import onnx

_LEN = 2  # protobuf's wire type of length-delimited fields
_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload_len: int) -> bytes:
    """The tag and length that precede a length-delimited field's payload."""
    return _varint(number << 3 | _LEN) + _varint(payload_len)


def _repeated(desc) -> bool:
    # protobuf 6 deprecates `label` for `is_repeated`; older releases have only `label`
    return desc.is_repeated if hasattr(desc, "is_repeated") else desc.label == desc.LABEL_REPEATED


def _without(message, field: str):
    """A new message of `message`'s type with all its fields but `field` (copied; `message` is not changed)."""
    out = type(message)()
    for desc, value in message.ListFields():
        if desc.name == field:
            continue
        if _repeated(desc):
            getattr(out, desc.name).extend(value)
        elif desc.type == desc.TYPE_MESSAGE:
            getattr(out, desc.name).CopyFrom(value)
        else:
            setattr(out, desc.name, value)
    return out


def _chunks(proto: onnx.ModelProto) -> Iterable[bytes]:
    """The file's bytes: the model without its graph, then the graph's field holding the graph without its
    initializers and then its initializers, one at a time. `proto` is not changed."""
    head = _without(proto, "graph").SerializeToString()
    body = _without(proto.graph, "initializer").SerializeToString()
    initializers = proto.graph.initializer
    sizes = [t.ByteSize() for t in initializers]
    graph_len = len(body) + sum(len(_field(_GRAPH_INITIALIZER, n)) + n for n in sizes)
    yield head
    yield _field(_MODEL_GRAPH, graph_len) + body
    for t, n in zip(initializers, sizes, strict=True):
        yield _field(_GRAPH_INITIALIZER, n) + t.SerializeToString()


def save_proto(proto: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write `proto` to `path` as one ONNX file (weights inside, as `onnx.save` writes them) in bounded memory."""
    with open(path, "wb") as f:
        for chunk in _chunks(proto):
            f.write(chunk)
