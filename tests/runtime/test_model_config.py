"""A model's own configuration (`vit_serve.runtime.model_config`): REPO/NAME/config.toml read, checked, merged over
its config.pbtxt (config.toml wins key by key), and laid over the server's limits and load spec."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vit_serve.runtime.discovery import scan
from vit_serve.runtime.model_config import ModelConfig, read_model_config
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.spec import LoadSpec
from vit_serve.tome import parse_tome


def _model(root: Path, name: str, ckpt: Path, toml: str | None = None) -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    shutil.copy(ckpt, folder / "1" / "w.safetensors")
    if toml is not None:
        (folder / "config.toml").write_text(toml)
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    import vit_serve

    path = tmp_path_factory.mktemp("ckpt") / "w.safetensors"
    vit_serve.save(vit_serve.create_model("Ti/16", num_classes=3, img_size=32, depth=1), path)
    return path


def test_config_toml_is_read_and_laid_over_the_servers_limits(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('max_batch = 4\nmax_delay_ms = 1.5\ninstances = 2\nbatch_curve = false\nthreads = 1\n'
                    'tome = "2"\ndecode = "contract"\nmonitoring = false\ndrift_window = 50\n')
    config = read_model_config(path)
    assert config == ModelConfig(max_batch=4, max_delay_ms=1.5, instances=2, batch_curve=False, threads=1,
                                 tome="2", decode="contract", monitoring=False, drift_window=50)
    limits = config.over(RunnerLimits(max_batch=16, max_delay_ms=5, max_queue=99, instances=1))
    assert (limits.max_batch, limits.max_delay_ms, limits.max_queue, limits.instances, limits.batch_curve) == (
        4, 1.5, 99, 2, False)
    spec = config.spec(LoadSpec(path="m", threads=4, decode="fast"))
    assert (spec.threads, spec.decode, spec.tome, spec.compile) == (1, None, parse_tome("2"), False)
    assert config.monitoring_changes() == {"monitoring": False, "drift_window": 50}


def test_an_empty_config_leaves_the_server_defaults(tmp_path):
    server = RunnerLimits(max_batch=8, max_queue=7)
    assert ModelConfig().over(server) == server
    spec = LoadSpec(path="m", threads=3, decode="exact")
    assert ModelConfig().spec(spec) is spec
    # config.pbtxt's 0 means unset: the server's value stays
    assert ModelConfig(max_batch=0, max_queue=0, instances=0).over(server) == server


@pytest.mark.parametrize(("text", "match"), [
    ("max_batchh = 4\n", "unknown key 'max_batchh'"),
    ("max_batch = -1\n", "max_batch"),
    ('decode = "turbo"\n', "decode"),
    ('tome = "x"\n', "token merging: bad r 'x'"),
    ("max_batch = \n", "not a readable TOML file"),
])
def test_a_wrong_config_toml_names_the_file_and_key(tmp_path, text, match):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        read_model_config(path)
    assert str(path) in str(info.value)


def test_config_toml_wins_over_config_pbtxt_key_by_key(tmp_path, ckpt):
    """Both files: merged, config.toml's value where both set one (max_batch), each file's own elsewhere."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    folder = _model(tmp_path, "vit", ckpt, "max_batch = 2\nthreads = 1\n")
    config = pb.ModelConfig(name="vit", max_batch_size=8, dynamic_batching=pb.ModelDynamicBatching(
        max_queue_delay_microseconds=2500, default_queue_policy=pb.ModelQueuePolicy(max_queue_size=32)))
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
    (entry,) = scan(tmp_path).values()
    assert entry.config == ModelConfig(max_batch=2, max_delay_ms=2.5, max_queue=32, threads=1)


def test_a_broken_config_toml_makes_its_model_unusable_not_the_others(tmp_path, ckpt):
    _model(tmp_path, "bad", ckpt, "instances = 0.5\n")
    _model(tmp_path, "good", ckpt, "instances = 2\n")
    entries = scan(tmp_path)
    assert entries["bad"].error is not None and "instances" in entries["bad"].error
    assert entries["good"].error is None and entries["good"].config.instances == 2
