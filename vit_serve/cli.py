"""The `vit-serve` command: parse, call the library, print. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from vit_serve import __version__, quickstart
from vit_serve.cli_parser import OneLineParser, argument_type
from vit_serve.config import RESAMPLE_MODES
from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS
from vit_serve.resolution import parse_resolution

RESOLUTION = argument_type(parse_resolution)  # 384 or HxW, as an argparse type


def _cmd_convert(args: argparse.Namespace) -> int:
    from vit_serve.checkpoints import convert

    model = convert(args.src, args.dst, res=args.res, num_classes=args.num_classes, arch=args.arch,
                    resample_mode=args.resample_mode, overwrite=args.force)
    c = model.cfg
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.dst}: {c.embed_dim}d x {c.depth} layers, patch {c.patch_size}, "
          f"{c.img_size[0]}x{c.img_size[1]}, {c.num_classes} classes, {params / 1e6:.1f}M params, "
          f"resample={c.resample_mode}, gelu={c.gelu}, ln_eps={c.layer_norm_eps:g}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    try:
        from vit_serve import inspect
    except ImportError as e:  # matplotlib is not a runtime dependency
        raise OSError(str(e)) from e
    from vit_serve.checkpoints import load

    inspect.check_settings(args.head_fusion, args.discard_ratio)
    images = inspect.find_images(args.images) if args.images else None
    inspect.check_out_dir(args.out, overwrite=args.force)
    model = load(args.ckpt)
    result = inspect.inspect_model(model, images, args.out, head_fusion=args.head_fusion,
                                   discard_ratio=args.discard_ratio, overwrite=args.force)
    for name in result["files"]:
        print(Path(args.out) / name)
    if "skipped" in result["filters"]:
        print(f"filters.png skipped: {result['filters']['skipped']}")
    return 0


def _parse_kv(text: str) -> dict[str, object]:
    """"depth=4,embed_dim=96,gelu=tanh" -> {"depth": 4, "embed_dim": 96, "gelu": "tanh"} (JSON values)."""
    out: dict[str, object] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"bad key=value {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_TRAIN_HELP = {
    "mode": "pretrain (Adam, wd 0.1) or finetune (SGD momentum 0.9, new zero head, resampled position embeddings)",
    "objective": "classify, or mpp (masked patch prediction, paper §4.6)",
    "data": "digits (embedded default), an ImageFolder root with train/ and val/, cifar10:DIR or cifar100:DIR",
    "model": "preset for pretraining (digits, S/16, vit_base_patch16_224, ...)",
    "model_args": "ViTConfig overrides, e.g. depth=6,embed_dim=128",
    "init": "checkpoint to fine-tune (any supported format)",
    "res": "training resolution, e.g. 384 or 384x512",
    "batch_size": "global batch per optimizer step (across processes and accumulation)",
    "device": "auto, cpu, cuda or xla",
}


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from vit_serve.train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag, hint = "--" + f.name.replace("_", "-"), hints[f.name]
        kw: dict[str, object] = {"default": None, "help": _TRAIN_HELP.get(f.name, f"default: {f.default}")}
        if bool in (hint, *typing.get_args(hint)):  # bool and bool | None: --flag / --no-flag
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if f.name == "res":
            kw["type"] = RESOLUTION
        elif f.name == "model_args":
            kw["type"] = _parse_kv
        elif f.name == "few_shot":
            kw["type"] = _parse_ints
        else:
            base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
            kw["type"] = base[0] if base[0] in (int, float) else str
        p.add_argument(flag, **kw)


def _cmd_train(args: argparse.Namespace) -> int:
    from vit_serve.train.config import TrainConfig, resolve
    from vit_serve.train.loop import train

    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    train(resolve(args.config, flags))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from vit_serve.train.eval_checkpoint import run_eval

    result = run_eval(args.checkpoint, args.data, res=args.res, out=args.out, few_shot=args.few_shot,
                      batch_size=args.batch_size, workers=args.workers)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from vit_serve.runtime.backends import check_model
    from vit_serve.serve.app import run
    from vit_serve.serve.settings import ServeSettings

    flags = {k: getattr(args, k) for k in ("model", "backend", "triton_url", "triton_timeout_s",
                                           "triton_startup_timeout_s", "model_name", "host", "port",
                                           "max_batch", "max_delay_ms", "max_queue", "max_images_per_request",
                                           "threads", "device", "decode",
                                           "default_model", "model_control", "repository_poll_s", "load_models",
                                           "version_policy", "repository_api", "grpc_port", "unload_grace_s",
                                           "grpc_max_message_bytes", "store", "store_password_file",
                                           "store_secret_file", "api_keys", "api_keys_file",
                                           "admin_api_keys", "admin_api_keys_file", "allow_any_key_admin",
                                           "open_probes", "cors_origins", "root_path", "grpc_max_concurrent_calls",
                                           "ssl_certfile", "ssl_keyfile", "request_ids", "otel")}
    try:
        settings = ServeSettings(**{k: v for k, v in flags.items() if v is not None})  # flags over VIT_SERVE_*
    except ValidationError as e:
        names = ["_".join(str(p) for p in err["loc"]) for err in e.errors()]
        raise ValueError("; ".join(f"--{n.replace('_', '-')} / VIT_SERVE_{n.upper()}: {err['msg']}"
                                   for n, err in zip(names, e.errors(), strict=True))) from None
    if (args.engine or settings.engine) == "ray":  # its replicas load the model: no TensorRT needed here
        return _serve_on_ray(args, settings)
    check_model(settings)  # missing files, no TensorRT: one line here rather than a traceback from uvicorn
    run(settings)
    return 0


def _serve_on_ray(args: argparse.Namespace, settings) -> int:
    try:
        from vit_serve.deploy import ray as on_ray
    except ImportError as e:  # the ray extra is missing: its message names it
        raise OSError(str(e)) from None
    # without --replica-gpus the replicas see no GPU (on_ray.actor_options: CUDA_VISIBLE_DEVICES="")
    actor: dict = {"num_cpus": 1 if args.replica_cpus is None else args.replica_cpus}
    if args.replica_gpus:
        actor["num_gpus"] = args.replica_gpus
    replicas = args.replicas or 1
    autoscaling = {"min_replicas": replicas, "max_replicas": args.max_replicas} if args.max_replicas else None
    try:
        on_ray.run(settings, address=args.address, num_replicas=replicas, autoscaling_config=autoscaling,
                   ray_actor_options=actor, ingress_replicas=args.ingress_replicas or 1)
    except RuntimeError as e:  # the application did not start (or cannot fit the cluster): its reason, in one line
        raise OSError(str(e)) from None
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from vit_serve.predict import PredictOptions, predict

    fields = [f.name for f in dataclasses.fields(PredictOptions)]
    try:
        result = predict(PredictOptions(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None}))
    except ImportError as e:  # an optional extra (pyarrow, tqdm, ray) is missing: its message names the extra
        raise OSError(str(e)) from e
    done = f"{result.written} rows written, {result.skipped} already there"
    bad = f", {len(result.errors)} unreadable (listed in {result.out}.errors.jsonl)" if result.errors else ""
    print(f"{result.out}: {done}{bad}; {result.rows} rows in all; {result.images_per_s:.1f} images/s")
    if result.nothing_readable:
        raise ValueError(f"none of the {len(result.errors)} files could be read (first: {result.errors[0][0]}: "
                         f"{result.errors[0][1]})")
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from vit_serve.quickstart import build, serve

    paths = build(args.out, args.pretrain_steps, args.finetune_steps)
    if not args.no_serve:
        serve(paths, args.host, args.port)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="vit-serve", description="Train, export and serve Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vit-serve {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    c = sub.add_parser("convert", help="convert any supported checkpoint to vit-serve's .safetensors format",
                       description="Convert a vit_jax/big_vision .npz, timm, transformers or torchvision "
                                   "checkpoint (file, folder or hub id) to one vit-serve .safetensors file.")
    c.add_argument("src", help="checkpoint file, folder, or hub id (timm/<name>, google/vit-...)")
    c.add_argument("dst", help="output .safetensors path")
    c.add_argument("--res", type=RESOLUTION, help="resample position embeddings to this resolution (384 or HxW)")
    c.add_argument("--num-classes", type=int, help="replace the head with a zero-initialised K-way head")
    c.add_argument("--arch", help="architecture name when the weights do not say (e.g. vit_base_patch16_224)")
    c.add_argument("--resample-mode", choices=RESAMPLE_MODES,
                   help="position-embedding resampling to use and record (default: the source's own)")
    c.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    c.set_defaults(func=_cmd_convert)

    i = sub.add_parser("inspect", help="the ViT paper's Figure 6/7 inspections of a checkpoint, as PNGs + JSON",
                       description="Write attention rollout (Figure 6), patch-embedding filter PCA, position-"
                                   "embedding similarity and mean attention distance (Figure 7) figures and "
                                   "inspect.json with every number behind them.")
    i.add_argument("ckpt", metavar="CKPT", help="checkpoint (any format `convert` reads)")
    i.add_argument("--images", metavar="DIR",
                   help="folder of jpg/jpeg/png/bmp/webp images (default: matplotlib's sample pictures)")
    i.add_argument("--out", metavar="DIR", required=True, help="output folder (created; must be new or empty)")
    i.add_argument("--head-fusion", choices=HEAD_FUSIONS, default=DEFAULT_HEAD_FUSION,
                   help=f"rollout head fusion (default {DEFAULT_HEAD_FUSION})")
    i.add_argument("--discard-ratio", type=float, default=DEFAULT_DISCARD_RATIO,
                   help="rollout: fraction of the weakest attention weights to drop per layer, in [0, 1) "
                        f"(default {DEFAULT_DISCARD_RATIO})")
    i.add_argument("--force", action="store_true", help="write into an existing non-empty output folder")
    i.set_defaults(func=_cmd_inspect)

    t = sub.add_parser("train", help="pre-train or fine-tune a ViT (flags override --config)",
                       description="Pre-train or fine-tune a ViT with the paper's recipes. Multi-process: "
                                   "torchrun --nproc-per-node N -m vit_serve train ...")
    t.add_argument("--config", help="a .json or .toml file of options (flags override it)")
    _add_train_flags(t)
    t.set_defaults(func=_cmd_train)

    e = sub.add_parser("eval", help="top-1/top-5, confusion matrix and few-shot accuracy of a checkpoint")
    e.add_argument("checkpoint")
    e.add_argument("--data", default="digits", help=_TRAIN_HELP["data"])
    e.add_argument("--res", type=RESOLUTION, help="evaluate at this resolution (position embeddings resampled)")
    e.add_argument("--out", help="folder for confusion.png and eval.json")
    e.add_argument("--few-shot", type=_parse_ints, default=(), help="e.g. 1,5,10,25 images per class")
    e.add_argument("--batch-size", type=int, default=128)
    e.add_argument("--workers", type=int, default=0)
    e.set_defaults(func=_cmd_eval)

    s = sub.add_parser("serve", help="serve a model over HTTP (FastAPI): /classify, /explain, /v2, /metrics",
                       description="Serve a repository of models (a folder of exports and checkpoints, or of "
                                   "NAME/VERSION/ folders), one checkpoint (torch), an exported NAME.onnx "
                                   "(onnxruntime), a TensorRT engine, or a model on a Triton server. Every option "
                                   "is also an environment variable VIT_SERVE_<OPTION> (e.g. VIT_SERVE_MAX_BATCH); "
                                   "flags win.")
    s.add_argument("model", metavar="REPO|MODEL", nargs="?",
                   help="a folder of models, or one: checkpoint, NAME.onnx (NAME.json beside it), NAME.engine, or "
                        "a Triton model name (default: $VIT_SERVE_MODEL)")
    s.add_argument("--backend", choices=("auto", "torch", "onnxruntime", "tensorrt", "triton"),
                   help="default auto: from MODEL's suffix (.onnx, .engine/.plan, else torch)")
    s.add_argument("--triton-url", help="Triton server for --backend triton (default localhost:8000)")
    s.add_argument("--triton-timeout-s", type=float,
                   help="longest wait for one Triton call before answering 504 (default 10)")
    s.add_argument("--triton-startup-timeout-s", type=float,
                   help="how long start-up waits for the Triton server and model (default 30)")
    s.add_argument("--model-name", help="name shown to clients and under /v2 (default: MODEL's file stem)")
    s.add_argument("--host", help="default 127.0.0.1")
    s.add_argument("--port", type=int, help="default 8000")
    s.add_argument("--grpc-port", type=int, help="serve the Open Inference Protocol over gRPC on this port "
                   "(off by default; 0 picks a free port)")
    s.add_argument("--grpc-max-message-bytes", type=int, help="largest gRPC message either way (default 64 MiB)")
    s.add_argument("--grpc-max-concurrent-calls", type=int, help="gRPC calls in flight at once; beyond: "
                   "RESOURCE_EXHAUSTED (default 32)")
    s.add_argument("--root-path", help="the URL prefix a proxy serves the gateway under (e.g. /vit; uvicorn's "
                   "root_path)")
    s.add_argument("--max-batch", type=int, help="largest batch (default 16; 1 turns batching off)")
    s.add_argument("--max-delay-ms", type=float, help="longest wait for a batch to fill (default 5; 0: off)")
    s.add_argument("--max-queue", type=int, help="requests waiting before 503 (default 256)")
    s.add_argument("--max-images-per-request", type=int, help="images one /v2 or gRPC inference request may carry "
                   "(default 0: the model's max_batch; more run as several batches)")
    s.add_argument("--threads", type=int, help="intra-op threads of the model runtime (default: its own)")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), help="torch / onnxruntime device (default auto)")
    s.add_argument("--default-model", help="the model of requests that name none (default: the only one)")
    s.add_argument("--model-control", choices=("none", "poll", "explicit"),
                   help="none (default: load REPO at start), poll (follow REPO's changes), explicit (--load-model "
                        "and the repository API)")
    s.add_argument("--repository-poll-s", type=float, help="seconds between scans with --model-control poll "
                   "(default 15)")
    s.add_argument("--unload-grace-s", type=float, help="longest wait of an unloaded or replaced version for its "
                   "requests in flight, which then get 503 (default 30)")
    s.add_argument("--load-model", dest="load_models", action="append", metavar="NAME",
                   help="--model-control explicit: load NAME at start (repeatable; * loads all)")
    s.add_argument("--version-policy", help="versions of each model to serve: latest (default), latest:N, all, "
                   "specific:V1,V2 (a model's config.pbtxt version_policy wins)")
    s.add_argument("--store", metavar="URL", help="where crops for GET /explain?id= live: memory (default, this "
                   "process) or redis://HOST:PORT/DB (shared by every replica)")
    s.add_argument("--store-password-file", metavar="FILE", help="the Redis password, read from FILE (a Secret "
                   "mount) rather than the URL")
    s.add_argument("--store-secret-file", metavar="FILE", help="the store secret (16+ bytes, the same on every "
                   "replica) that explain ids and Redis entries are HMACs with; default: one made per process "
                   "(or VIT_SERVE_STORE_SECRET)")
    s.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                   help="a key requests must send (Authorization: Bearer KEY or X-API-Key; repeatable; "
                        "sha256:HEX for a hash); default: no key needed")
    s.add_argument("--api-keys-file", metavar="FILE", help="keys (or sha256:HEX hashes), one a line")
    s.add_argument("--admin-api-key", dest="admin_api_keys", action="append", metavar="KEY",
                   help="a key that may also load and unload models (repeatable)")
    s.add_argument("--admin-api-keys-file", metavar="FILE", help="admin keys, one a line")
    s.add_argument("--allow-any-key-admin", dest="allow_any_key_admin", action="store_const", const=True,
                   help="without admin keys, any valid key (anyone, with no API key set) may load and unload models "
                        "(default: nobody may)")
    s.add_argument("--no-open-probes", dest="open_probes", action="store_const", const=False,
                   help="health, readiness and metrics need a key too")
    s.add_argument("--cors-origin", dest="cors_origins", action="append", metavar="ORIGIN",
                   help="an origin browsers may call from (repeatable; * for any); default: CORS off")
    s.add_argument("--ssl-certfile", help="TLS certificate (PEM): HTTPS and gRPC over TLS")
    s.add_argument("--ssl-keyfile", help="TLS private key (PEM)")
    s.add_argument("--no-request-ids", dest="request_ids", action="store_const", const=False,
                   help="neither echo X-Request-ID nor log a line per request")
    s.add_argument("--otel", action="store_const", const=True,
                   help="OpenTelemetry tracing (needs vit-serve[otel]): a span per request, context passed on to "
                        "Triton; endpoint, service name, sampler from the standard OTEL_* variables")
    s.add_argument("--no-repository-api", dest="repository_api", action="store_const", const=False,
                   help="answer 403 on POST /v2/repository/... (index, load, unload)")
    s.add_argument("--decode", choices=("fast", "exact", "contract"),
                   help="upload decoding: fast (the default: JPEG DCT-domain downscaling), exact (timm's "
                        "transform, bit for bit) or contract (the model's own contract field)")
    r = s.add_argument_group("Ray Serve (--engine ray; pip install 'vit-serve[ray]')")
    r.add_argument("--engine", choices=("local", "ray"),
                   help="local (default: this process) or ray (the gateway as a Ray Serve application, each model "
                        "version its own deployment)")
    r.add_argument("--address", help="the Ray cluster (auto, ray://HOST:10001; default: a local one)")
    r.add_argument("--replicas", type=int, help="replicas of each model deployment (default 1)")
    r.add_argument("--max-replicas", type=int, help="autoscale each model from --replicas up to this")
    r.add_argument("--ingress-replicas", type=int,
                   help="gateway replicas (default 1; more need --store redis://... for GET /explain?id=)")
    r.add_argument("--replica-cpus", type=float, help="CPUs per model replica (default 1)")
    r.add_argument("--replica-gpus", type=float, help="GPUs per model replica (default 0)")
    s.set_defaults(func=_cmd_serve)

    pr = sub.add_parser("predict", help="offline batch prediction over image files -> JSONL, CSV or Parquet",
                        description="Predict every image of SRC with MODEL and write one row per image (path, top-k "
                                    "labels, indices and scores as /classify answers them). Resumable: a rerun "
                                    "skips the rows already written.")
    pr.add_argument("model", metavar="MODEL", help="a checkpoint, an exported NAME.onnx (NAME.json beside it), an "
                    "engine, or a repository folder (what `vit-serve serve REPO` takes; then --model NAME)")
    pr.add_argument("src", metavar="SRC", help="a folder (recursive), a glob ('photos/**/*.jpg'), a text file of "
                    "paths (one a line), one image, or with --image-folder an ImageFolder root")
    pr.add_argument("--out", required=True, help="preds.jsonl, preds.csv or preds.parquet (a folder of parts)")
    pr.add_argument("--model", dest="model_name", metavar="NAME", help="the model of a repository folder (its "
                    "newest version)")
    pr.add_argument("--top-k", type=int, help="classes per row (default 5)")
    pr.add_argument("--batch-size", type=int, help="images per model call (default 16)")
    pr.add_argument("--workers", type=int, help="decode workers (default: as the gateway, max(2, min(4, cores - "
                    "model threads)))")
    pr.add_argument("--processes", action="store_const", const=True, help="decode in worker processes instead "
                    "of threads")
    pr.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto")
    pr.add_argument("--threads", type=int, help="intra-op threads of the model runtime (default: its own)")
    pr.add_argument("--decode", choices=("fast", "exact", "contract"), help="decode path, as `serve --decode` "
                    "(default fast, the gateway's default)")
    pr.add_argument("--embeddings", action="store_const", const=True, help="add the pre-logits embedding")
    pr.add_argument("--normalize", action="store_const", const=True, help="L2-normalise the embeddings")
    pr.add_argument("--explain", action="store_const", const=True, help="write the attention-rollout maps to "
                    "OUT.rollout.npy ([N, gh, gw]; each row's rollout_index names its map)")
    pr.add_argument("--image-folder", action="store_const", const=True, help="SRC is an ImageFolder "
                    "(SRC/<class>/...): rows also carry target and target_index")
    pr.add_argument("--max-pixels", type=int, help="larger images are skipped as unreadable (default 50 M)")
    pr.add_argument("--part-rows", type=int, help="Parquet: rows per part file (default 4096; a part is also "
                    "written every 30 s)")
    pr.add_argument("--engine", choices=("local", "ray"), help="local (default) or ray (Ray Data; pip install "
                    "'vit-serve[ray]')")
    pr.add_argument("--address", help="--engine ray: the cluster (auto, ray://HOST:10001; default: a local one)")
    pr.add_argument("--actors", type=int, help="--engine ray: model actors (default: one per GPU, or one per CPU "
                    "of the cluster)")
    pr.add_argument("--force", action="store_const", const=True, help="replace an OUT written with another model "
                    "or other settings")
    pr.add_argument("--quiet", action="store_const", const=True, help="no progress bar or per-file lines")
    pr.set_defaults(func=_cmd_predict)

    q = sub.add_parser("quickstart", help="train on the digits set, fine-tune at 2x resolution, export, serve",
                       description="The whole product on the embedded default: pre-train a small ViT on the "
                                   "digits set (16x16), fine-tune it at 32x32, export ONNX and a Triton repository, "
                                   "and serve it with the web page. Finished steps in --out are reused.")
    q.add_argument("--out", default="runs/quickstart", help="working folder (default: runs/quickstart)")
    q.add_argument("--pretrain-steps", type=int, default=quickstart.PRETRAIN_STEPS,
                   help=f"default {quickstart.PRETRAIN_STEPS} (~1.5 min on 2 CPU cores)")
    q.add_argument("--finetune-steps", type=int, default=quickstart.FINETUNE_STEPS,
                   help=f"default {quickstart.FINETUNE_STEPS} at 32x32 (~30 s)")
    q.add_argument("--host", default="127.0.0.1")
    q.add_argument("--port", type=int, default=8000)
    q.add_argument("--no-serve", action="store_true", help="stop after the export")
    q.set_defaults(func=_cmd_quickstart)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        # CheckpointError and bad sizes are ValueErrors with a message written for the user.
        print(f"vit-serve {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
