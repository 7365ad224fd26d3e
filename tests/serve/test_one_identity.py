"""One identity per request (issue 38, point 2): a request sends one key header (two are 400 / INVALID_ARGUMENT),
the key is verified once and everything that depends on the caller (the explain scope, the rate bucket, the
queue's level) reads that verified identity; a presented `sha256:HEX` is never a key. Keys given no level get the
middle of the key files' levels (point 6). Against a real gateway under uvicorn on a real socket (httpx, and
grpcio with tritonclient's generated stubs for metadata tritonclient cannot send)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest
from gateway_helpers import live_app, settings_for

from vit_serve.serve.admission import DEFAULT_PRIORITY
from vit_serve.serve.security import KeyRing
from vit_serve.serve.settings import SecuritySettings

ALICE, BOB = "alice-key-6f0c21", "bob-key-93d7e4"
ALICE_HASH = "sha256:" + hashlib.sha256(ALICE.encode()).hexdigest()
JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def gateway(tiny_ckpt) -> Iterator[tuple[str, str]]:
    """A gateway with Alice's and Bob's keys, HTTP and gRPC; yields (URL, gRPC address)."""
    with live_app(settings_for(tiny_ckpt, api_keys=[ALICE, BOB], grpc_port=0)) as (url, app):
        yield url, app.state.grpc.address


def test_two_key_headers_are_400_and_never_read_another_tenants_crop(gateway, photos):
    url, _ = gateway
    jpeg = photos["coffee.jpg"]
    with httpx.Client(base_url=url, timeout=60) as c:
        classified = c.post("/classify", content=jpeg, headers={**JPEG, "X-API-Key": ALICE})
        assert classified.status_code == 200
        image_id = classified.json()["id"]
        assert c.get(f"/explain?id={image_id}&format=json", headers={"X-API-Key": ALICE}).status_code == 200
        assert c.get(f"/explain?id={image_id}", headers={"X-API-Key": BOB}).status_code == 404  # not Bob's
        # The attack: Alice's key hash (which a deployment may hold openly) first, Bob's own key last.
        attacks = [[("X-API-Key", ALICE_HASH), ("X-API-Key", BOB)],
                   [("X-API-Key", BOB), ("X-API-Key", ALICE_HASH)],
                   [("Authorization", f"Bearer {ALICE_HASH}"), ("X-API-Key", BOB)],
                   [("X-API-Key", ALICE_HASH), ("Authorization", f"Bearer {BOB}")],
                   [("Authorization", f"Bearer {ALICE_HASH}"), ("Authorization", f"Bearer {BOB}")],
                   [("X-API-Key", BOB), ("X-API-Key", BOB)]]  # even the same key twice: one header
        for headers in attacks:
            for r in (c.get(f"/explain?id={image_id}", headers=headers),
                      c.get(f"/explain?id={image_id}&format=json", headers=headers),
                      c.post("/classify", content=jpeg, headers=[*headers, *JPEG.items()])):  # the membership oracle
                assert r.status_code == 400, (headers, r.status_code)
                assert "one key" in r.json()["detail"] and "image/png" not in r.headers.get("content-type", "")
                assert "map" not in r.text and image_id not in r.text
        # A hash presented alone is not a key, in either header.
        for headers in ({"X-API-Key": ALICE_HASH}, {"Authorization": f"Bearer {ALICE_HASH}"}):
            r = c.get(f"/explain?id={image_id}", headers=headers)
            assert r.status_code == 401 and "not valid" in r.json()["detail"]
        # Bob with his one key still sees his own images only.
        own = c.post("/classify", content=jpeg, headers={**JPEG, "Authorization": f"Bearer {BOB}"}).json()["id"]
        assert own != image_id
        assert c.get(f"/explain?id={own}&format=json", headers={"X-API-Key": BOB}).status_code == 200


def test_grpc_refuses_two_keys_and_a_presented_hash(gateway):
    grpc = pytest.importorskip("grpc")
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc.service_pb2_grpc import GRPCInferenceServiceStub

    _, address = gateway
    with grpc.insecure_channel(address) as channel:
        stub = GRPCInferenceServiceStub(channel)

        def code(metadata) -> tuple[str, str]:
            try:
                stub.ModelMetadata(pb.ModelMetadataRequest(name="tiny"), metadata=metadata, timeout=30)
                return "OK", ""
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""

        assert code((("x-api-key", BOB),)) == ("OK", "")
        for metadata in ((("x-api-key", ALICE_HASH), ("x-api-key", BOB)),
                         (("authorization", f"Bearer {BOB}"), ("x-api-key", BOB))):
            status, message = code(metadata)
            assert status == "INVALID_ARGUMENT" and "one key" in message
        status, message = code((("x-api-key", ALICE_HASH),))
        assert status == "UNAUTHENTICATED" and "not valid" in message


def test_keys_without_a_level_get_the_middle_of_the_files_levels(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("gold name=gold priority=1\nbronze name=bronze priority=5\nplain name=plain\n")
    ring = KeyRing.from_settings(SecuritySettings(api_keys=["given"], api_keys_file=str(keys)))
    levels = {k: ring.identify(k).priority for k in ("gold", "bronze", "plain", "given")}
    assert levels == {"gold": 1, "bronze": 5, "plain": 3, "given": 3}  # never above a ranked key
    keys.write_text("silver name=silver priority=2\nbronze name=bronze priority=5\n")
    ring = KeyRing.from_settings(SecuritySettings(api_keys=["given"], api_keys_file=str(keys)))
    assert ring.identify("given").priority == 4  # (2 + 5) / 2, rounded toward the less urgent
    ring = KeyRing.from_settings(SecuritySettings(api_keys=["given"], api_keys_file=str(keys),
                                                  default_key_priority=7))
    assert ring.identify("given").priority == 7
    # No file gives a level: every key has the same one.
    assert KeyRing.from_settings(SecuritySettings(api_keys=["given"])).identify("given").priority == DEFAULT_PRIORITY
