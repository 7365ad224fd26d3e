"""The `vit-serve` command: parse, call the library, print. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
import warnings
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from vit_serve import __version__, quickstart
from vit_serve.cli.flags import (
    FlagDeprecationWarning,
    FlagField,
    HelpAll,
    add_flags,
    dataclass_fields,
    pydantic_fields,
    warn_hidden,
)
from vit_serve.cli_parser import OneLineParser, argument_type
from vit_serve.config import RESAMPLE_MODES
from vit_serve.resolution import parse_resolution
from vit_serve.rollout_options import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS

RESOLUTION = argument_type(parse_resolution)  # 384 or HxW, as an argparse type


def _cmd_convert(args: argparse.Namespace) -> int:
    from vit_serve.checkpoints import convert

    labels = templates = None
    if args.zero_shot is not None or args.templates is not None:
        from vit_serve.zeroshot import ZeroShotError, read_lines

        if args.zero_shot is None:
            raise ZeroShotError("--templates needs --zero-shot LABELS.txt")
        if args.num_classes is not None:
            raise ZeroShotError("--zero-shot builds its own head: drop --num-classes")
        labels = read_lines(args.zero_shot, "labels")
        templates = read_lines(args.templates, "templates") if args.templates else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = convert(args.src, args.dst, res=args.res, num_classes=args.num_classes, arch=args.arch,
                        resample_mode=args.resample_mode, overwrite=args.force, zero_shot=labels,
                        templates=templates, reference_images=args.reference_images, patch_size=args.patch_size)
    for w in caught:
        if "text tower not kept" in str(w.message):
            print(f"vit-serve convert: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    c = model.cfg
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.dst}: {c.embed_dim}d x {c.depth} layers, patch {c.patch_size}, "
          f"{c.img_size[0]}x{c.img_size[1]}, {c.num_classes} classes, {params / 1e6:.1f}M params, "
          f"resample={c.resample_mode}, gelu={c.gelu}, ln_eps={c.layer_norm_eps:g}"
          + (f", zero-shot head ({c.scores})" if labels is not None else ""))
    if model.reference is not None:
        print(f"reference: {model.reference.describe()}")
    return 0


def _cmd_inspect_drift(args: argparse.Namespace) -> int:
    """`vit-serve inspect --drift SOURCE --out FILE.png`: SOURCE (CKPT's place) is a gateway URL or a saved JSON."""
    try:
        from vit_serve.cli import drift_figure
    except ImportError as e:  # matplotlib is not a runtime dependency
        raise OSError(str(e)) from e

    unused = [flag for flag, value, default in (("--images", args.images, None), ("--tome", args.tome, None),
                                                 ("--head-fusion", args.head_fusion, DEFAULT_HEAD_FUSION),
                                                 ("--discard-ratio", args.discard_ratio, DEFAULT_DISCARD_RATIO))
              if value != default]
    if unused:
        raise ValueError(f"{', '.join(unused)} not used with --drift")
    out = Path(args.out)
    if out.is_dir():
        out = out / "drift.png"
    if out.exists() and not args.force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    report = drift_figure.load_drift(args.ckpt, args.model, args.model_version, args.api_key)
    print(drift_figure.draw_drift(report, out, overwrite=args.force))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.drift:
        return _cmd_inspect_drift(args)
    if args.model is not None or args.model_version is not None or args.api_key is not None:
        raise ValueError("--model, --version and --api-key are for --drift")
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
                                   discard_ratio=args.discard_ratio, overwrite=args.force, tome=args.tome)
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
    "grad_clip": "clip the gradient's global norm at this (0: no clipping); default: the recipe's (1, the paper's; "
                 "0 for the digits' fine-tune)",
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
    print(json.dumps(result.to_dict(), indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from vit_serve.runtime import LoadSpec, check
    from vit_serve.serve.app import run
    from vit_serve.serve.config_file import serve_settings
    from vit_serve.serve.settings import ServeSettings

    with warnings.catch_warnings(record=True) as hidden:  # a hidden flag given: one line each, where to set it
        warnings.simplefilter("always", FlagDeprecationWarning)
        warn_hidden(args, pydantic_fields(ServeSettings.flat_fields()), "VIT_SERVE_")
    for w in hidden:
        print(f"vit-serve serve: warning: {w.message}", file=sys.stderr)
    flags = {k: getattr(args, k, None) for k in ServeSettings.flat_fields()}
    settings = serve_settings(args.config, flags)  # flags over VIT_SERVE_* over --config FILE
    if settings.engine == "ray":  # its replicas load the model: no TensorRT needed here
        return _serve_on_ray(args, settings)
    check(LoadSpec.of(settings))  # missing files, no TensorRT: one line here rather than a traceback from uvicorn
    run(settings)
    return 0


def _missing(error: ImportError):
    """A command that cannot run without an extra: it says which module is missing, in one line."""

    def run(args: argparse.Namespace) -> int:
        raise OSError(f"{error} (pip install 'vit-serve[serve]')")

    return run


def _serve_on_ray(args: argparse.Namespace, settings) -> int:
    try:
        from vit_serve.deploy import ray as on_ray
    except ImportError as e:  # the ray extra is missing: its message names it
        raise OSError(str(e)) from None
    # The deployments' replicas and resources are settings (settings.ray; each model's config.toml may set its own).
    try:
        on_ray.run(settings, address=args.address)
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


def _cmd_tune(args: argparse.Namespace) -> int:
    from vit_serve.tune.report import report_text
    from vit_serve.tune.search import NO_WINNER_EXIT, TuneOptions, tune

    result = tune(TuneOptions(model=args.model, out=args.out, images=args.images, check_images=args.check_images,
                              p99_ms=args.p99_ms, min_agreement=args.min_agreement, budget_s=args.budget_s,
                              concurrency=args.concurrency, trial_s=args.trial_s, device=args.device,
                              force=args.force, progress=not args.no_progress))
    print(report_text(result), end="")
    for path in result.files.values():
        print(f"wrote {path}")
    return 0 if result.winner is not None else NO_WINNER_EXIT


def _positive(kind: type[int] | type[float]):
    """An argparse type: a number > 0 (kind int or float)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected a {'whole ' if kind is int else ''}number > 0, got {text!r}") from None
        if not value > 0:
            raise ValueError(f"expected a number > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return argument_type(parse)


def _convert_parser(c: argparse.ArgumentParser) -> None:
    """`vit-serve convert`."""
    c.add_argument("src", help="checkpoint file, folder, or hub id (hf-hub:OWNER/NAME)")
    c.add_argument("dst", help="output .safetensors path")
    c.add_argument("--res", type=RESOLUTION, help="resample position embeddings to this resolution (384 or HxW)")
    c.add_argument("--num-classes", type=int, help="replace the head with a zero-initialised K-way head")
    c.add_argument("--patch-size", type=int, metavar="P",
                   help="FlexiViT: resize the patch embedding to P x P (pseudo-inverse) and resample the position "
                        "embeddings to the new grid; P must divide the resolution")
    c.add_argument("--zero-shot", metavar="LABELS.txt",
                   help="build a zero-shot head (CLIP/SigLIP) from these labels, one per line, with the "
                        "checkpoint's text tower (open_clip's recipe); not with --num-classes")
    c.add_argument("--templates", metavar="TEMPLATES.txt",
                   help="prompt templates for --zero-shot, one per line, each with {} for the label "
                        "(default: 'a photo of a {}.')")
    c.add_argument("--arch", help="architecture name when the weights do not say (e.g. vit_base_patch16_224; "
                                  "open_clip:ViT-B-32 for open_clip state dicts)")
    c.add_argument("--resample-mode", choices=RESAMPLE_MODES,
                   help="position-embedding resampling to use and record (default: the source's own)")
    c.add_argument("--reference-images", metavar="DIR",
                   help="in-distribution images to build the model's reference from (OOD scores and drift; half "
                        "fit, half calibrate); the source's own is kept only without --res, --num-classes and "
                        "--zero-shot")
    c.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    c.set_defaults(func=_cmd_convert)


def _inspect_parser(i: argparse.ArgumentParser) -> None:
    """`vit-serve inspect`."""
    from vit_serve.tome_schedule import parse_tome

    i.add_argument("ckpt", metavar="CKPT", help="checkpoint (any format `convert` reads); with --drift, a "
                                                "running gateway's URL (http://HOST:PORT) or a saved JSON of its "
                                                "GET /models/NAME/drift")
    i.add_argument("--images", metavar="DIR",
                   help="folder of jpg/jpeg/png/bmp/webp images (default: matplotlib's sample pictures)")
    i.add_argument("--out", metavar="DIR", required=True, help="output folder (created; must be new or empty)")
    i.add_argument("--head-fusion", choices=HEAD_FUSIONS, default=DEFAULT_HEAD_FUSION,
                   help=f"rollout head fusion (default {DEFAULT_HEAD_FUSION})")
    i.add_argument("--discard-ratio", type=float, default=DEFAULT_DISCARD_RATIO,
                   help="rollout: fraction of the weakest attention weights to drop per layer, in [0, 1) "
                        f"(default {DEFAULT_DISCARD_RATIO})")
    i.add_argument("--tome", type=argument_type(parse_tome), metavar="R",
                   help="token merging (ToMe): r tokens merged per layer (13), one per layer (13,13,8) or r and "
                        "the schedule's inflection (16:-1); draws tome_<image>.png, the merged groups after the "
                        "last layer, and the rollout follows the merges")
    i.add_argument("--force", action="store_true", help="write into an existing non-empty output folder (with "
                                                            "--drift: overwrite the PNG)")
    i.add_argument("--drift", action="store_true",
                   help="draw a model version's drift instead (CKPT is then a gateway URL or a drift JSON file): "
                        "the window's OOD-score histogram against the reference's, and the classes that moved, "
                        "to the PNG --out (a folder: drift.png in it)")
    i.add_argument("--model", metavar="NAME", help="--drift from a gateway: the model's name")
    i.add_argument("--version", dest="model_version", metavar="N",
                   help="--drift from a gateway: the model's version (default: the one serving)")
    i.add_argument("--api-key", metavar="KEY", help="--drift from a gateway: its API key, if it needs one")
    i.set_defaults(func=_cmd_inspect)


def _train_parser(t: argparse.ArgumentParser) -> None:
    """`vit-serve train`: TrainConfig's fields as flags (`_add_train_flags`)."""
    t.add_argument("--config", help="a .json or .toml file of options (flags override it)")
    _add_train_flags(t)
    t.set_defaults(func=_cmd_train)


def _eval_parser(e: argparse.ArgumentParser) -> None:
    """`vit-serve eval`."""
    e.add_argument("checkpoint")
    e.add_argument("--data", default="digits", help=_TRAIN_HELP["data"])
    e.add_argument("--res", type=RESOLUTION, help="evaluate at this resolution (position embeddings resampled)")
    e.add_argument("--out", help="folder for confusion.png and eval.json")
    e.add_argument("--few-shot", type=_parse_ints, default=(), help="e.g. 1,5,10,25 images per class")
    e.add_argument("--batch-size", type=int, default=128)
    e.add_argument("--workers", type=int, default=0)
    e.set_defaults(func=_cmd_eval)


def _serve_parser(s: argparse.ArgumentParser) -> None:
    """`vit-serve serve`: ServeSettings' fields as flags (their `Flag`s), and Ray Serve's launch options."""
    try:
        from vit_serve.serve.setting_scopes import SERVER_SETTINGS, scope_of
        from vit_serve.serve.settings import RayDeploymentSettings, ServeSettings
    except ImportError as e:  # without the serve extra: `serve` takes anything and says what is missing
        s.add_argument("args", nargs=argparse.REMAINDER)
        s.set_defaults(func=_missing(e))
        return
    settings = pydantic_fields(ServeSettings.flat_fields())
    s.epilog = (f"{sum(f.flag.hidden for f in settings)} rarely used flags are not listed (still accepted, "
                "deprecated on the command line): every setting is a VIT_SERVE_<NAME> variable and a --config key "
                "(README, \"Settings by scope\"); --help-all lists every option.")
    s.add_argument("--help-all", action=HelpAll, help="show every option, the rarely used ones too, and exit")
    s.add_argument("--config", metavar="FILE",
                   help="settings from a .toml or .json file of setting names (max_batch = 8; paths relative to the "
                        "file's folder); flags and VIT_SERVE_* variables win over it")
    # The server's flags by scope (vit_serve.serve.setting_scopes), then the model defaults, then the options of
    # one backend or store each.
    groups = {scope.value: s.add_argument_group(f"server: {scope.value}") for scope in SERVER_SETTINGS}
    groups |= {"model": s.add_argument_group(
        "model defaults (each model's own REPO/NAME/config.toml or config.pbtxt wins over them)"),
        "triton": s.add_argument_group("Triton backend (--backend triton)"),
        "store": s.add_argument_group("explain store (the crops kept for GET /explain?id=)"),
        "sampler": s.add_argument_group("payload sampler (requests kept for labelling)")}
    r = s.add_argument_group("Ray Serve (--engine ray; pip install 'vit-serve[ray]')")
    ray = set(RayDeploymentSettings.model_fields)

    def group_of(field: FlagField) -> str:
        return field.flag.section or scope_of(field.name).value

    add_flags(r, [f for f in settings if f.name not in ray], section="ray", groups=groups, group_of=group_of)
    # Where the cluster is: the launch's own option (deploy.ray.run's address), not a setting of the gateway.
    r.add_argument("--address", help="the Ray cluster (auto, ray://HOST:10001; default: a local one)")
    add_flags(r, [f for f in settings if f.name in ray], section="ray", groups=groups, group_of=group_of)
    s.set_defaults(func=_cmd_serve)


def _predict_parser(pr: argparse.ArgumentParser) -> None:
    """`vit-serve predict`: PredictOptions' fields as flags (their `Flag`s)."""
    from vit_serve.predict.options import PredictOptions

    add_flags(pr, dataclass_fields(PredictOptions))
    pr.set_defaults(func=_cmd_predict)


def _quickstart_parser(q: argparse.ArgumentParser) -> None:
    """`vit-serve quickstart`."""
    q.add_argument("--out", default="runs/quickstart", help="working folder (default: runs/quickstart)")
    q.add_argument("--pretrain-steps", type=int, default=quickstart.PRETRAIN_STEPS,
                   help=f"default {quickstart.PRETRAIN_STEPS} at 16x16")
    q.add_argument("--finetune-steps", type=int, default=quickstart.FINETUNE_STEPS,
                   help=f"default {quickstart.FINETUNE_STEPS} at 32x32")
    q.add_argument("--host", default="127.0.0.1")
    q.add_argument("--port", type=int, default=8000)
    q.add_argument("--no-serve", action="store_true", help="stop after the export")
    q.set_defaults(func=_cmd_quickstart)


def _tune_parser(t: argparse.ArgumentParser) -> None:
    """`vit-serve tune`."""
    from vit_serve.tune import result as tune

    t.add_argument("model", metavar="MODEL",
                   help="a checkpoint (runtimes, precisions and token merging are swept too) or an exported "
                        "NAME.onnx with NAME.json (its runner settings only)")
    t.add_argument("--out", default="runs/tune", type=Path, metavar="DIR",
                   help="outputs: serve.toml, tune.json, tune.md, tune.png, exports/, logs/ (new or empty; "
                        "default runs/tune)")
    t.add_argument("--images", type=Path, metavar="DIR",
                   help="uploads: the images of DIR, each request made unique (default: built-in photos)")
    t.add_argument("--check-images", type=Path, metavar="DIR",
                   help="images top-1 agreement is measured on (default: views of the built-in photos)")
    t.add_argument("--p99-ms", type=_positive(float), metavar="MS", default=tune.DEFAULT_P99_MS,
                   help=f"the latency target (default {tune.DEFAULT_P99_MS:g})")
    t.add_argument("--min-agreement", type=float, metavar="F", default=tune.DEFAULT_MIN_AGREEMENT,
                   help="the floor on top-1 agreement with the fp32 model without token merging "
                        f"(default {tune.DEFAULT_MIN_AGREEMENT:g})")
    t.add_argument("--budget-s", type=_positive(float), metavar="S", default=tune.DEFAULT_BUDGET_S,
                   help=f"bound on the whole run, in seconds (default {tune.DEFAULT_BUDGET_S:g})")
    t.add_argument("--concurrency", type=_positive(int), metavar="N", default=tune.DEFAULT_CONCURRENCY,
                   help=f"concurrent clients (default {tune.DEFAULT_CONCURRENCY})")
    t.add_argument("--trial-s", type=_positive(float), metavar="S", default=tune.DEFAULT_TRIAL_S,
                   help=f"seconds of load measured per trial (default {tune.DEFAULT_TRIAL_S:g})")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default auto")
    t.add_argument("--force", action="store_true", help="write into a non-empty --out (exports there replaced)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    t.set_defaults(func=_cmd_tune)


# name -> (help, description, the function adding its flags): the flags are added only for the commands
# a parser is built for (`build_parser`), so that `vit-serve --help` imports no heavy module.
_COMMANDS: dict[str, tuple[str, str | None, Callable[[argparse.ArgumentParser], None]]] = {
    "convert": (
        "convert any supported checkpoint to vit-serve's .safetensors format",
        "Convert a vit_jax/big_vision .npz, timm, transformers, torchvision or "
        "open_clip checkpoint (file, folder or hub id) to one vit-serve .safetensors "
        "file (a CLIP/SigLIP text tower is kept).",
        _convert_parser),
    "inspect": (
        "the ViT paper's Figure 6/7 inspections of a checkpoint, as PNGs + JSON",
        "Write attention rollout (Figure 6), patch-embedding filter PCA, position-"
        "embedding similarity and mean attention distance (Figure 7) figures and "
        "inspect.json with every number behind them.",
        _inspect_parser),
    "train": (
        "pre-train or fine-tune a ViT (flags override --config)",
        "Pre-train or fine-tune a ViT with the paper's recipes. Multi-process: "
        "torchrun --nproc-per-node N -m vit_serve train ...",
        _train_parser),
    "eval": (
        "top-1/top-5, confusion matrix and few-shot accuracy of a checkpoint",
        None,
        _eval_parser),
    "serve": (
        "serve a model over HTTP (FastAPI): /classify, /explain, /v2, /metrics",
        "Serve a repository of models (a folder of exports and checkpoints, or of "
        "NAME/VERSION/ folders), one checkpoint (torch), an exported NAME.onnx "
        "(onnxruntime), a TensorRT engine, or a model on a Triton server. Every option "
        "is also an environment variable VIT_SERVE_<OPTION> (e.g. VIT_SERVE_MAX_BATCH) "
        "and a name in a --config file: flags win over the variables, which win over "
        "the file. The model defaults apply to the models without their own: a model's "
        "REPO/NAME/config.toml (or config.pbtxt) sets its own.",
        _serve_parser),
    "predict": (
        "offline batch prediction over image files -> JSONL, CSV or Parquet",
        "Predict every image of SRC with MODEL and write one row per image (path, top-k "
        "labels, indices and scores as /classify answers them). Resumable: a rerun "
        "skips the rows already written.",
        _predict_parser),
    "quickstart": (
        "train on the digits set, fine-tune at 2x resolution, export, serve",
        "The whole product on the embedded default: pre-train a small ViT on the "
        "digits set (16x16), fine-tune it at 32x32, export ONNX and a Triton repository, "
        "and serve it with the web page. Finished steps in --out are reused. Each step shows a progress bar with "
        f"its ETA; {quickstart.ESTIMATE}.",
        _quickstart_parser),
    "tune": (
        "find the gateway settings with the most images/s within a p99 target",
        "Measure the real gateway (unique uploads from concurrent clients over HTTP) "
        "with its defaults, then runtimes (torch, ONNX fp32 / int8, token merging; "
        "each checked for top-1 agreement), threads x decode workers, max batch and "
        "max delay, within --budget-s; print the table, draw throughput against p99, "
        "and write the winner's settings as OUT/serve.toml for `vit-serve serve "
        "--config`. Exits 3 when no setting meets the target.",
        _tune_parser),
}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The `vit-serve` parser; `commands`: those whose flags are added (None: all). The others are listed with
    their help, so the top-level --help is the same either way."""
    p = OneLineParser(prog="vit-serve", description="Train, export and serve Vision Transformers.")
    p.add_argument("--version", action="version", version=f"vit-serve {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, (help_, description, add_flags_of) in _COMMANDS.items():
        command = sub.add_parser(name, help=help_, description=description)
        if commands is None or name in commands:
            add_flags_of(command)
    return p


def _command_of(argv: Sequence[str]) -> str | None:
    """The command `argv` names: its first word that is not an option (the top level has no option taking a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser({_command_of(argv)} - {None})  # only the command run imports what its flags need
    args = parser.parse_args(argv)
    # A setting read by a deprecated environment name says which to set (vit_serve.serve.settings.ENV_RENAMED);
    # Python would hide this DeprecationWarning outside __main__.
    warnings.filterwarnings("default", r"VIT_SERVE_\w+ (is deprecated|and VIT_SERVE_)", DeprecationWarning)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        # CheckpointError and bad sizes are ValueErrors with a message written for the user.
        print(f"vit-serve {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return getattr(e, "exit_code", 1)  # 2: a usage error / refused input (UnsupportedCheckpoint, OptionError)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
