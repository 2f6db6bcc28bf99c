"""TLS on a service's port and mTLS between services, with certificates made here by openssl and real
handshakes on loopback: a client without the CA, a service without a client certificate and a
plaintext caller are refused with UNAVAILABLE; with them, calls and a whole generation work."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cosine.common.config import ServiceSettings
from cosine.common.server import GrpcService, open_channel
from cosine.router.v1 import router_pb2, router_pb2_grpc

from .conftest import start_services, stop_services


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
            "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)


def make_cert(d: Path, name: str, ca: str) -> None:
    """A certificate for 127.0.0.1 and localhost, good for server and client authentication."""
    (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
                                   "basicConstraints=CA:FALSE\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed (apt-get install -y openssl)")
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "stranger-ca")
    make_cert(d, "service", "ca")
    make_cert(d, "stranger", "stranger-ca")
    return d


def client_settings(pki: Path, cert: str | None = "service", ca: str = "ca") -> ServiceSettings:
    own = {"tls_cert_file": str(pki / f"{cert}.crt"), "tls_key_file": str(pki / f"{cert}.key")} if cert else {}
    return ServiceSettings(tls_ca_file=str(pki / f"{ca}.crt"), **own)


async def health_status(channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    return reply.status


async def refused(channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await health_status(channel)
    return exc.value.code()


async def start(pki: Path, mutual: bool, health_port: int | None = None) -> GrpcService:
    settings = ServiceSettings(port=0, drain_timeout_s=0.1, tls_cert_file=str(pki / "service.crt"), tls_key_file=str(pki / "service.key"),
                               tls_client_ca_file=str(pki / "ca.crt") if mutual else "", health_port=health_port)
    service = GrpcService("tls", settings, lambda server: [])
    await service.start()
    await service.set_ready()
    return service


async def test_tls_port_refuses_clients_without_the_ca_and_plaintext(pki):
    service = await start(pki, mutual=False)
    target = f"127.0.0.1:{service.port}"
    try:
        async with open_channel(target, client_settings(pki, cert=None)) as channel:  # the CA, no client certificate
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        async with open_channel(target, client_settings(pki, cert=None, ca="stranger-ca")) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(target) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    finally:
        await service.stop()


async def test_mtls_port_refuses_callers_without_a_certificate_of_the_ca(pki):
    service = await start(pki, mutual=True)
    target = f"127.0.0.1:{service.port}"
    try:
        async with open_channel(target, client_settings(pki, cert=None)) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
        async with open_channel(target, client_settings(pki, cert="stranger")) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
        async with open_channel(target, client_settings(pki)) as channel:
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await service.stop()


async def test_plaintext_health_port_for_probes(pki):
    service = await start(pki, mutual=True, health_port=0)
    try:
        assert service.health_port and service.health_port != service.port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.health_port}") as channel:
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
            # health alone: the service's other methods (reflection here) are not on this port
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                [r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        await service.stop()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.health_port}") as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    finally:
        await service.stop()


def test_half_a_key_pair_is_refused(pki):
    with pytest.raises(ValueError, match="go together"):
        ServiceSettings(tls_cert_file=str(pki / "service.crt"))
    with pytest.raises(ValueError, match="mTLS"):
        ServiceSettings(tls_client_ca_file=str(pki / "ca.crt"))


async def test_generation_through_services_that_all_speak_mtls(pki, tiny_dirs, redis_server, services):
    """Every service with mTLS on its port and on its channels; the result equals the plaintext cluster's."""
    tls = {"tls_cert_file": str(pki / "service.crt"), "tls_key_file": str(pki / "service.key"),
           "tls_client_ca_file": str(pki / "ca.crt"), "tls_ca_file": str(pki / "ca.crt")}
    secure = await start_services(tiny_dirs, redis_server, **tls)
    request = router_pb2.GenerateRequest(prompt=b"Once upon a time, in a land", max_new_tokens=12)

    async def tokens(channel) -> list[int]:
        ids = []
        async for reply in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
            if reply.WhichOneof("kind") == "chunk":
                ids += reply.chunk.token_ids
        return ids

    try:
        async with open_channel(secure.router, client_settings(pki)) as channel:
            got = await tokens(channel)
        async with grpc.aio.insecure_channel(services.router) as channel:
            want = await tokens(channel)
        assert got == want and got
        async with open_channel(secure.router, client_settings(pki, cert=None)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await tokens(channel)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_services(secure)
