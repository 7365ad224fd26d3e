"""The troubleshooting page (docs/troubleshooting.md), from the error tables in the code: the gateway's
(`vit_serve.serve.errors.STATUSES`, `GRPC_CODES`) and, for the CLI, which has no table, what the code says: the
exit codes its error classes carry, and every one-line error the commands raise themselves (read from their
source). Written by `python docs/gen_reference.py`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The modules whose own raises are the commands' messages (a library's errors reach the CLI as its message).
CLI_SOURCES = ("vit_serve/cli/main.py", "vit_serve/cli/drift_figure.py", "vit_serve/cli_parser.py", "export/cli.py")
# Where the classes that choose their exit code live: every module of both packages.
PACKAGES = ("vit_serve", "export")

# What to do about each HTTP status the gateway answers. Written here, by status: the generator refuses a status
# of the table without its advice, so a new one cannot be left out.
ADVICE: dict[int, str] = {
    400: "The request is malformed (a missing file field, two key headers, an option the model does not take): "
         "the message names what; fix the request.",
    401: "Send an API key: `Authorization: Bearer KEY` or `X-API-Key: KEY` (the server has `--api-key` set).",
    403: "The key is valid but may not do this (loading and unloading models needs an admin key, "
         "`--admin-api-key`, or `--allow-any-key-admin`).",
    404: "No such model, version or stored image: `GET /models` lists what is served; an `/explain?id=` image "
         "is kept for `store_ttl_s` seconds and `store_size` images.",
    408: "The body did not arrive within `body_timeout_s` of its headers: a slow link or a stalled upload; "
         "raise `VIT_SERVE_BODY_TIMEOUT_S` for slow links.",
    413: "The body or the decoded image is over the limit the message names (`max_body_bytes`, `max_pixels`): "
         "send a smaller image, or raise the limit.",
    415: "The bytes are no image in a format the gateway reads (JPEG, PNG, WebP, BMP, ... as Pillow reads): "
         "send an image file.",
    422: "A well-formed request with an unusable value (a bad `top_k`, a priority beyond `priority_levels`, a "
         "corrupt or truncated image): the message names the field.",
    429: "This API key is over its rate or its requests in flight (`max_concurrent_per_key`): wait for "
         "`Retry-After` seconds.",
    500: "A bug: the gateway logs the traceback with the request id (`X-Request-ID`); report it with that line.",
    503: "The model is loading or not loaded (check `GET /readyz`), its queue is full, the backend (Triton, "
         "Ray) is down, or the server is shutting down: retry after `Retry-After` seconds; a full queue often "
         "means more clients than `max_batch` x `instances` can serve: see the tuning guide.",
    504: "The model did not answer within `request_timeout_s`: the server is overloaded or the timeout is "
         "too short for the model on this machine.",
}
# Statuses answered outside the table (by the middleware and FastAPI), and where.
OUTSIDE_TABLE: dict[int, str] = {
    401: "no or an unknown API key (vit_serve.serve.security)",
    408: "a body slower than `body_timeout_s` (vit_serve.serve.slow_clients)",
    413: "a body over `max_body_bytes`, before it is read (vit_serve.serve.errors.BodyTooLargeError)",
    422: "FastAPI's validation of parameters (a list of the fields at fault)",
    500: "anything unexpected (vit_serve.serve.middleware.ErrorBoundary)",
    503: "over `max_connections` connections (vit_serve.serve.slow_clients), or shutting down",
}

# Their gRPC codes, where the gRPC service answers them itself (vit_serve.serve.grpc) or has no such answer.
OUTSIDE_GRPC: dict[int, str] = {401: "UNAUTHENTICATED", 408: "(HTTP only)"}


def code(text: str) -> str:
    return text if text.startswith("(") else f"`{text}`"


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _meaning(cls: type) -> str:
    """An error class's first docstring sentence, without the status it names (the table gives it)."""
    if cls.__name__ == "ServingError":
        return "any other refusal"
    doc = (cls.__doc__ or cls.__name__).split("\n\n")[0]
    return _cell(doc.split(" (HTTP")[0].split(": 429")[0].rstrip("."))


def _http_section() -> list[str]:
    from vit_serve.serve import errors

    statuses = sorted(set(errors.STATUSES.values()) | set(OUTSIDE_TABLE))
    missing = [s for s in statuses if s not in ADVICE]
    if missing:
        raise SystemExit(f"docs/troubleshooting.py: no advice for HTTP status {missing}: add it to ADVICE")
    out = ["## HTTP API", "",
           "Every error answers JSON with one line of text: `{\"detail\": message}`, or `{\"error\": message}` "
           "under `/v2` (the Open Inference Protocol's body). gRPC calls get the status code beside it. The "
           "errors, from `vit_serve.serve.errors.STATUSES`:", "",
           "| Status | gRPC code | Error | What it means | What to do |", "|---|---|---|---|---|"]
    for status in statuses:
        classes = [c for c, s in errors.STATUSES.items() if s == status]
        grpc = OUTSIDE_GRPC.get(status) or errors.grpc_status_code(status).name
        what = "; ".join(_meaning(c) for c in classes)
        if status in OUTSIDE_TABLE:
            what = f"{what}; also: {OUTSIDE_TABLE[status]}" if what else OUTSIDE_TABLE[status]
        names = ", ".join(f"`{c.__name__}`" for c in classes) or "-"
        out.append(f"| {status} | {code(grpc)} | {names} | {_cell(what)} | {_cell(ADVICE[status])} |")
    retry = "`QueueFullError`, `RateLimitedError`, `BackendUnavailableError`"
    return [*out, "", f"Answers that advise a retry ({retry}, a server shutting down or over its connections) "
                  "carry `Retry-After` in seconds.", ""]


def _text(node: ast.expr) -> str | None:
    """A message as written: a string, or an f-string with its {expressions}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def _own_nodes(fn: ast.FunctionDef):
    """The nodes of `fn`'s body, not those of the functions defined in it (listed under their own name)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    stack = [n for n in fn.body if not isinstance(n, nested)]
    while stack:
        node = stack.pop(0)
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, nested))


def cli_messages() -> list[tuple[str, str, str, str]]:
    """(file, function, error class, message) for every error a command raises or prints itself."""
    rows = []
    for rel in CLI_SOURCES:
        tree = ast.parse((ROOT / rel).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in _own_nodes(fn):
                call = node.exc if isinstance(node, ast.Raise) else node if isinstance(node, ast.Call) else None
                if not isinstance(call, ast.Call) or not call.args:
                    continue
                name = ast.unparse(call.func)
                if isinstance(node, ast.Call) and name != "_error":
                    continue
                message = _text(call.args[0])
                if message:
                    rows.append((rel, fn.name, name if name != "_error" else "(printed)", message))
    return rows


def exit_code_classes() -> list[tuple[str, str, int, str]]:
    """(module, class, exit code, docstring) for every error class that sets its own `exit_code`."""
    rows = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                for stmt in cls.body:
                    if (isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "exit_code" for t in stmt.targets)
                            and isinstance(stmt.value, ast.Constant)):
                        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                        module = module.replace("export.", "vit_export.", 1).removesuffix(".__init__")
                        rows.append((module, cls.name, stmt.value.value, ast.get_docstring(cls) or ""))
    return rows


def _cli_section() -> list[str]:
    from vit_export.cli import EXIT_NO_TENSORRT

    from vit_serve.tune.result import NO_WINNER_EXIT

    out = ["## Command line", "",
           "The CLI keeps no table of its errors: each is one line on stderr, `vit-serve COMMAND: error: "
           "MESSAGE` (or `vit-export: error: MESSAGE`), the message written for the user, and a non-zero exit "
           "code. `--help` prints the full usage. What the code says about them:", "",
           "### Exit codes", "", "| Code | Meaning |", "|---|---|",
           "| 0 | Done. |",
           "| 1 | An error: a file that is missing or exists, a checkpoint that cannot be read, a bad size, a "
           "failed parity check (`vit-export`: the files are written with the failure recorded). |",
           "| 2 | A usage error: a flag that does not parse (argparse) or options refused before anything is "
           "written (the classes below). |",
           f"| {EXIT_NO_TENSORRT} | `vit-export --format tensorrt` without TensorRT: the ONNX files are written. |",
           f"| {NO_WINNER_EXIT} | `vit-serve tune`: no setting met the latency and agreement targets. |", "",
           "### Errors that exit 2", "", "| Error | Module | What it means |", "|---|---|---|"]
    out += [f"| `{cls}` | `{module}` | {_cell(doc)} |" for module, cls, code, doc in exit_code_classes() if code == 2]
    out += ["", "### Messages of the commands themselves", "",
            "Raised by the command-line modules (the libraries' own messages reach the CLI as they are: see each "
            "command's `--help`). `{...}` stands for the value at hand.", "",
            "| Where | Error | Message |", "|---|---|---|"]
    out += [f"| `{rel}` `{fn}` | `{cls}` | `` {_cell(msg)} `` |" for rel, fn, cls, msg in cli_messages()]
    return [*out, ""]


def troubleshooting_page() -> str:
    from gen_reference import HEADER

    lines = ["# Troubleshooting", "",
             "Every error a user can meet at the command line and at the HTTP API, generated from the code's "
             "error tables. Something not here? The message itself names what is at fault; the "
             "[commands](reference/cli.md) and [settings](reference/settings.md) references say what each option "
             "takes.", "", *_cli_section(), *_http_section()]
    return HEADER + "\n".join(lines).rstrip() + "\n"
