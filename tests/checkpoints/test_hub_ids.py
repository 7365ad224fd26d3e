"""Hub ids need the `hf-hub:` prefix: a mistyped local path (`runs/best`) is a one-line "no such file" error from
every reader (`vit-serve serve`, `vit_serve.load`, the repository scan, `vit-serve predict`) and never a hub
download. The bare `timm/<name>` and `google/vit-*` of earlier releases still are hub ids, with a FutureWarning.

No network: `huggingface_hub.snapshot_download` is replaced by a function that fails the test if anything calls
it, so a call that would have gone to the hub shows as a failure (HF_HUB_OFFLINE alone would turn it into an
error message that also names the path)."""

from __future__ import annotations

import pytest

import vit_serve
from vit_serve.checkpoints import CheckpointError
from vit_serve.checkpoints.hub import parse_hub_id
from vit_serve.cli import main
from vit_serve.runtime.discovery import scan

MISTYPED = ["runs/best", "runs/best/", "checkpoints/vit-b16_run3", "best"]


@pytest.fixture
def no_hub(monkeypatch, tmp_path) -> list[str]:
    """Every hub download attempted, recorded (and refused); run in an empty working directory."""
    import huggingface_hub

    calls: list[str] = []

    def snapshot_download(repo_id, *args, **kwargs):
        calls.append(repo_id)
        raise AssertionError(f"a hub download of {repo_id!r} was attempted")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VIT_SERVE_MODEL", raising=False)
    return calls


@pytest.mark.parametrize("path", MISTYPED)
def test_serve_with_a_mistyped_path_is_one_line_naming_it(no_hub, capsys, path):
    assert main(["serve", path, "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"vit-serve serve: error: no such file or folder: {path}"), err
    assert "hf-hub:" in err  # says how a hub id is written
    assert no_hub == []


@pytest.mark.parametrize("path", MISTYPED)
def test_load_and_scan_of_a_mistyped_path_never_reach_the_hub(no_hub, path):
    with pytest.raises(CheckpointError, match="no such file"):
        vit_serve.load(path)
    with pytest.raises(FileNotFoundError, match=f"no such file or folder: {path}"):
        scan(path)
    assert no_hub == []


def test_predict_with_a_mistyped_model_path_never_reaches_the_hub(no_hub, capsys, tmp_path):
    (tmp_path / "images").mkdir()
    code = main(["predict", "runs/best", str(tmp_path / "images"), "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code != 0 and "runs/best" in err and err.count("\n") == 1, err
    assert no_hub == []


def test_hub_ids_need_the_prefix():
    assert parse_hub_id("hf-hub:timm/vit_tiny_patch16_224.augreg_in21k") == "timm/vit_tiny_patch16_224.augreg_in21k"
    assert parse_hub_id("hf-hub:someone/my-vit") == "someone/my-vit"
    for local in MISTYPED:
        assert parse_hub_id(local) is None
    with pytest.raises(CheckpointError, match="hf-hub:OWNER/NAME"):
        parse_hub_id("hf-hub:no-owner")


def test_bare_timm_and_google_ids_still_work_with_a_deprecation_warning(no_hub):
    with pytest.warns(FutureWarning, match="write hf-hub:timm/vit_tiny_patch16_224.hub_ids_test"):
        assert parse_hub_id("timm/vit_tiny_patch16_224.hub_ids_test") == "timm/vit_tiny_patch16_224.hub_ids_test"
    with pytest.warns(FutureWarning, match="write hf-hub:google/vit-base-patch16-224-hub-ids-test"):
        assert parse_hub_id("google/vit-base-patch16-224-hub-ids-test") == "google/vit-base-patch16-224-hub-ids-test"


def test_a_prefixed_hub_id_goes_to_the_hub(no_hub):
    """The prefix is what sends a name to the hub: `hf-hub:someone/my-vit` asks for it (here refused)."""
    with pytest.raises(CheckpointError, match="cannot fetch 'someone/my-vit'"):
        vit_serve.load("hf-hub:someone/my-vit")
    assert no_hub == ["someone/my-vit"]


def test_a_gated_repository_says_how_to_get_its_weights(monkeypatch, tmp_path):
    """DINOv3's weights are gated by Meta's licence: huggingface_hub's own GatedRepoError (what it raises without
    an accepted licence and token) becomes one line naming the licence, HF_TOKEN and the local-folder way."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    repo = "facebook/dinov3-vits16-pretrain-lvd1689m"

    def snapshot_download(repo_id, *args, **kwargs):
        response = httpx.Response(401, request=httpx.Request("GET", f"https://huggingface.co/api/models/{repo_id}"))
        raise GatedRepoError(f"401 Client Error. Cannot access gated repo {repo_id}.", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=f"cannot fetch '{repo}'.*gated repository.*HF_TOKEN") as e:
        vit_serve.load(f"hf-hub:{repo}")
    assert "\n" not in str(e.value) and "never redistributes" in str(e.value)
