"""The Open Inference Protocol (KServe v2) wire format: inference requests in, responses out.

Supports JSON tensor data and the binary tensor data extension: a request whose header
`Inference-Header-Content-Length: N` says its first N bytes are the JSON, followed by the raw tensors of the
inputs that carry `parameters.binary_data_size`, in input order; outputs are returned raw after the JSON when
`outputs[i].parameters.binary_data` (or the request's `parameters.binary_data_output`) is true. Tensors are
row-major, little-endian; BYTES elements are 4-byte little-endian lengths followed by the bytes. In JSON, BYTES
inputs (encoded images) are base64 strings; BYTES outputs (classifications) are plain strings, as Triton writes them.

The classification extension (Triton's): a requested output with `parameters.classification = k` comes back as
BYTES [B, min(k, n)] of "value:index[:label]" strings, the k highest values of each batch row (n values) best
first; value as C's `%f` (six decimals), the label omitted when the output has none. `classification = 0` means
the raw tensor, as in Triton. Output parameters other than `binary_data` and `classification` answer 400.

JSON bodies are strict RFC 8259: NaN and +-inf outputs are written as null (`schemas.json_bytes`).

Every input is checked against the request's `RequestBounds` from its header (name, datatype, shape) before its
data is converted or decoded: at most `max_images` encoded images (BYTES elements) or rows, and for a numeric input
at most `max_values` elements. Shapes are counted with Python integers (numpy's int64 product wraps), so no shape
overflows; a request body that is not JSON, nested past the parser's recursion limit included, is a 400
(`load_json`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vit_serve.serve.errors import BadRequestError
from vit_serve.serve.schemas import json_bytes

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
HEADER_LENGTH = "Inference-Header-Content-Length"
IMAGE = "image"  # the input of encoded images (BYTES), beside the graphs' own pixel_values
OUTPUT_PARAMETERS = ("binary_data", "classification")
MAX_DIMS = 32  # numpy 1.x's most dimensions of an array (2.x allows 64)
IMAGES_SETTING = "VIT_SERVE_MAX_IMAGES_PER_REQUEST"


def load_json(data: bytes, what: str) -> Any:
    """`data` parsed as JSON; 400 naming `what` when it is not JSON, is not UTF-8, is nested deeper than the
    parser's recursion limit, or holds an integer longer than int() converts."""
    try:
        return json.loads(data)
    except RecursionError:
        raise BadRequestError(f"{what} is nested too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and int()'s digit limit are ValueErrors
        raise BadRequestError(f"{what} is not JSON ({e})") from None


@dataclass(frozen=True)
class RequestBounds:
    """What one inference request may carry: `max_images` encoded images (a BYTES input's elements) or rows (a
    numeric input's first dimension), and `max_values` elements of a numeric input (that many images' values)."""

    max_images: int
    max_values: int

    def check(self, name: str, datatype: str, shape: list[int]) -> int:
        """The element count of a checked spec (`check_spec`); 400 naming the limit beyond the bounds."""
        count = math.prod(shape)  # Python integers: exact, whatever the shape
        images = count if datatype == "BYTES" else (shape[0] if shape else 1)
        if images > self.max_images:
            raise BadRequestError(f"input {name!r}: {images} images in one request, over the limit of "
                                  f"{self.max_images} ({IMAGES_SETTING}, --max-images-per-request; by default "
                                  f"the model's max_batch)")
        if datatype != "BYTES" and count > self.max_values:
            raise BadRequestError(f"input {name!r}: shape {shape} holds {count} values, more than "
                                  f"{self.max_images} images of this model hold ({self.max_values})")
        return count


@dataclass
class Tensor:
    """One input: numeric data as an array of `shape`, or BYTES as a list of byte strings."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray | list[bytes]


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, Tensor]
    outputs: list[dict[str, Any]] | None  # None: every output
    parameters: dict[str, Any] = field(default_factory=dict)

    def binary_output(self, out: dict[str, Any] | None) -> bool:
        """Whether an output goes back raw (its own binary_data, else the request's binary_data_output)."""
        params = (out or {}).get("parameters") or {}
        if "binary_data" in params:
            return bool(params["binary_data"])
        return bool(self.parameters.get("binary_data_output", False))

    @staticmethod
    def class_count(out: dict[str, Any]) -> int:
        """The output's classification count (0: the raw tensor)."""
        return int((out.get("parameters") or {}).get("classification", 0))


@dataclass
class OutputTensor:
    """One output of a response: numeric data as an array, or BYTES as a flat list of byte strings."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray | list[bytes]
    binary: bool


def _bytes_elements(raw: memoryview, name: str, count: int) -> list[bytes]:
    """The BYTES elements of raw tensor data, refused as soon as there are more than `count` (the shape's)."""
    out: list[bytes] = []
    i = 0
    while i < len(raw):
        if len(out) == count:
            raise BadRequestError(f"input {name!r}: more BYTES elements than its shape holds ({count})")
        if i + 4 > len(raw):
            raise BadRequestError(f"input {name!r}: truncated BYTES element length")
        (n,) = struct.unpack_from("<I", raw, i)
        if i + 4 + n > len(raw):
            raise BadRequestError(f"input {name!r}: BYTES element of {n} bytes runs past the data")
        out.append(bytes(raw[i + 4:i + 4 + n]))
        i += 4 + n
    return out


def _count(shape: list[int]) -> int:
    return math.prod(shape)  # exact: numpy's int64 product wraps ([2**32, 2**32] -> 0)


def check_spec(name: object, datatype: object, shape: object) -> None:
    """400 unless an input names itself, a datatype and a shape of at most MAX_DIMS non-negative integers."""
    if not isinstance(name, str) or not isinstance(datatype, str) or not isinstance(shape, list) \
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadRequestError("each input needs a name, a datatype and a shape of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise BadRequestError(f"input {name!r}: {len(shape)} dimensions; at most {MAX_DIMS}")


def _finite(t: Tensor) -> Tensor:
    arr = t.data
    if isinstance(arr, np.ndarray) and arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise BadRequestError(f"input {t.name!r}: values must be finite {t.datatype} numbers (NaN, inf or out of "
                              f"range)")
    return t


def _bytes_tensor(name: str, shape: list[int], items: list[bytes]) -> Tensor:
    if len(items) != _count(shape):
        raise BadRequestError(f"input {name!r}: {len(items)} BYTES elements for shape {shape}")
    return Tensor(name, "BYTES", shape, items)


def _dtype(name: str, datatype: str) -> np.dtype:
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise BadRequestError(f"input {name!r}: unknown datatype {datatype!r}")
    return dtype


def tensor_from_raw(name: str, datatype: str, shape: list[int], raw: memoryview | bytes) -> Tensor:
    """An input from its raw bytes (row-major little-endian; BYTES: 4-byte length + bytes per element)."""
    raw = memoryview(raw)
    if datatype == "BYTES":
        return _bytes_tensor(name, shape, _bytes_elements(raw, name, _count(shape)))
    dtype, count = _dtype(name, datatype), _count(shape)
    if len(raw) != count * dtype.itemsize:
        raise BadRequestError(f"input {name!r}: {len(raw)} bytes of binary data, but {datatype} {shape} needs "
                              f"{count * dtype.itemsize}")
    return _finite(Tensor(name, datatype, shape, np.frombuffer(raw, dtype=dtype).reshape(shape)))


def tensor_from_values(name: str, datatype: str, shape: list[int], values: Any) -> Tensor:
    """An input from its elements: numbers (nested or flat), or for BYTES a flat list of byte strings."""
    if datatype == "BYTES":
        return _bytes_tensor(name, shape, [bytes(v) for v in values])
    dtype = _dtype(name, datatype)
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values are refused by _finite
            arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise BadRequestError(f"input {name!r}: data is not {datatype} numbers ({e})") from e
    if arr.size != _count(shape):
        raise BadRequestError(f"input {name!r}: {arr.size} values for shape {shape}")
    return _finite(Tensor(name, datatype, shape, arr.reshape(shape)))


def _tensor(spec: dict[str, Any], raw: memoryview | None, bounds: RequestBounds) -> Tensor:
    name, datatype, shape = spec.get("name"), spec.get("datatype"), spec.get("shape")
    check_spec(name, datatype, shape)
    count = bounds.check(name, datatype, shape)  # before any data is converted or decoded
    if raw is not None:
        return tensor_from_raw(name, datatype, shape, raw)
    if datatype == "BYTES":
        data = spec.get("data")
        flat = data if isinstance(data, list) else [data]
        if len(flat) != count:
            raise BadRequestError(f"input {name!r}: {len(flat)} BYTES elements for shape {shape}")
        try:
            items = [base64.b64decode(s, validate=True) for s in flat]
        except (binascii.Error, TypeError, ValueError) as e:
            raise BadRequestError(f"input {name!r}: JSON BYTES elements must be base64 strings ({e})") from e
        return tensor_from_values(name, datatype, shape, items)
    if datatype in DTYPES and "data" not in spec:
        raise BadRequestError(f"input {name!r} has neither data nor parameters.binary_data_size")
    return tensor_from_values(name, datatype, shape, spec.get("data"))


def _header_length(value: str, body_length: int) -> int:
    text = value.strip()
    # ASCII digits only: str.isdigit also takes superscripts ("\u00b2"), which int() refuses
    if not (text.isascii() and text.isdigit()) or len(text) > 20 or int(text) > body_length:
        raise BadRequestError(f"{HEADER_LENGTH} {value[:24]!r} is not a length within the body")
    return int(text)


def parse_infer_request(body: bytes, header_length: str | None, bounds: RequestBounds) -> InferRequest:
    """The request body (JSON, or JSON + binary tensors) -> InferRequest; 400 on anything malformed or beyond
    `bounds`."""
    if header_length is not None:
        n = _header_length(header_length, len(body))
        head, rest = body[:n], memoryview(body)[n:]
    else:
        head, rest = body, memoryview(b"")
    doc = load_json(head, "the inference request header")
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise BadRequestError("an inference request is a JSON object with a non-empty list of inputs")
    inputs: dict[str, Tensor] = {}
    offset = 0
    for spec in doc["inputs"]:
        if not isinstance(spec, dict):
            raise BadRequestError("each input must be a JSON object")
        size = (spec.get("parameters") or {}).get("binary_data_size")
        raw = None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(rest):
                raise BadRequestError(f"input {spec.get('name')!r}: binary_data_size {size!r} runs past the body")
            raw = rest[offset:offset + size]  # a view: no copy of the tensor bytes
            offset += size
        tensor = _tensor(spec, raw, bounds)
        inputs[tensor.name] = tensor
    if offset != len(rest):
        raise BadRequestError(f"{len(rest) - offset} bytes of binary data belong to no input")
    outputs = doc.get("outputs")
    if outputs is not None and (not isinstance(outputs, list)
                                or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs)):
        raise BadRequestError("outputs must be a list of objects with a name")
    for out in outputs or []:
        check_output_parameters(out)
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequestError("parameters must be an object")
    request_id = doc.get("id")
    return InferRequest(request_id if isinstance(request_id, str) else None, inputs, outputs, params)


def check_output_parameters(out: dict[str, Any]) -> None:
    """400 for an output parameter other than binary_data and classification, or a bad value of one."""
    name, params = out["name"], out.get("parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise BadRequestError(f"output {name!r}: parameters must be an object")
    unknown = sorted(set(params) - set(OUTPUT_PARAMETERS))
    if unknown:
        raise BadRequestError(f"output {name!r}: unknown parameter {unknown[0]!r} (supported: "
                              f"{', '.join(OUTPUT_PARAMETERS)})")
    k = params.get("classification", 0)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise BadRequestError(f"output {name!r}: parameters.classification must be a non-negative integer "
                              f"(got {k!r})")
    if not isinstance(params.get("binary_data", False), bool):
        raise BadRequestError(f"output {name!r}: parameters.binary_data must be true or false")


def classify(arr: np.ndarray, k: int, labels: list[str] | None) -> tuple[list[int], list[bytes]]:
    """Triton's classification of an output [B, ...] -> (shape [B, min(k, n)], the flat "value:index[:label]"
    strings of each row's k highest values, best first; ties by index, NaN last)."""
    rows = np.asarray(arr).reshape(arr.shape[0], -1)
    count = min(k, rows.shape[1])
    out: list[bytes] = []
    for row in rows:
        for i in np.argsort(-row, kind="stable")[:count]:
            text = f"{float(row[i]):f}:{int(i)}"  # std::to_string(float) in Triton: printf's %f
            if labels is not None and i < len(labels):
                text += f":{labels[i]}"
            out.append(text.encode())
    return [rows.shape[0], count], out


def bytes_blob(items: list[bytes]) -> bytes:
    """BYTES elements as raw tensor data: each a 4-byte little-endian length, then the bytes."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def encode_infer_response(model: str, version: str, request_id: str | None,
                          outputs: list[OutputTensor]) -> tuple[bytes, dict[str, str]]:
    """The outputs -> (body, headers): strict JSON, then the binary outputs' raw bytes, in order."""
    header: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": []}
    if request_id is not None:
        header["id"] = request_id
    blobs: list[bytes] = []
    for out in outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        if out.datatype == "BYTES":
            items = list(out.data)
            if out.binary:
                blobs.append(bytes_blob(items))
            else:
                entry["data"] = [b.decode("utf-8", "replace") for b in items]
        else:
            arr = np.ascontiguousarray(out.data, dtype=DTYPES[out.datatype])
            if out.binary:
                blobs.append(arr.tobytes())
            else:
                entry["data"] = arr.ravel().tolist()
        if out.binary:
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        header["outputs"].append(entry)
    head = json_bytes(header)
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return b"".join([head, *blobs]), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}
