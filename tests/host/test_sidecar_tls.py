"""An https sidecar behind a private CA (``[sidecar] ca_file``, docs/reference/configuration.md): the host's
job and probe connections trust the CA of that file (and only it); without it the same sidecar's certificate
is refused. The config refuses a ``ca_file`` for an http sidecar and one holding no certificate. Real TLS on
loopback: a certificate for 127.0.0.1 from a CA made here."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kits.hostapp import HostFiles, base_document

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import ConnectorError
from aip_crewai.host.config import HostConfigError, load_settings
from aip_crewai.host.http.lifespan import _probe_http, _sidecar_http
from aip_crewai.host.settings import SidecarSettings
from aip_crewai.host.sidecars.client import DispatchProgress, SidecarClient

pytestmark = pytest.mark.timeout(60)


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None, signer: ec.EllipticCurvePrivateKey
) -> x509.Certificate:
    """A CA certificate (``issuer`` None: self-signed) or a server certificate for 127.0.0.1 signed by ``issuer``,
    with the extensions strict verification asks for."""
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    is_ca = issuer is None
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name if issuer is None else issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
            critical=False,
        )
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


@pytest.fixture
def private_ca(tmp_path: Path) -> tuple[str, ssl.SSLContext]:
    """(the CA's PEM, a server context holding a certificate for 127.0.0.1 it signed)."""
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("aip-crewai test CA", ca_key, None, ca_key)
    server = _certificate("127.0.0.1", server_key, ca, ca_key)
    (tmp_path / "server.pem").write_text(_pem(server))
    (tmp_path / "server.key").write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    return _pem(ca), context


@contextlib.asynccontextmanager
async def _https_sidecar(context: ssl.SSLContext) -> AsyncIterator[str]:
    """A loopback https server answering every request with a small JSON job view; yields its base URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            await reader.readuntil(b"\r\n\r\n")
            body = json.dumps({"action_id": "acme:x", "status": "running"}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    try:
        yield f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def _status_and_probe(sidecar: SidecarSettings) -> tuple[object, object]:
    """The job view through the job connections and ``/health`` through the probe's, or what each raised."""
    http, probe = _sidecar_http(sidecar, None), _probe_http(sidecar, None)
    outcomes: list[object] = []
    try:
        for call in (
            lambda: SidecarClient(http, max_response_bytes=1 << 20).get_job(
                ops.get("status"), DispatchProgress(), job_id="acme:x"
            ),
            lambda: probe.get("/health"),
        ):
            try:
                outcomes.append(await call())
            except Exception as exc:  # the outcome is the assertion
                outcomes.append(exc)
    finally:
        await http.aclose()
        await probe.aclose()
    return outcomes[0], outcomes[1]


async def test_a_sidecar_behind_a_private_ca_is_reached_with_its_ca_file_and_refused_without(private_ca):
    ca_pem, server_context = private_ca
    async with _https_sidecar(server_context) as url:
        view, health = await _status_and_probe(SidecarSettings("sidecar", url, "token", ca_pem=ca_pem))
        assert view == {"action_id": "acme:x", "status": "running"}
        assert getattr(health, "status_code", None) == 200, health
        view, health = await _status_and_probe(SidecarSettings("sidecar", url, "token"))  # the public CAs only
        assert isinstance(view, ConnectorError) and "certificate" in repr(view.__cause__).lower(), view
        assert "certificate" in repr(health).lower(), health


def test_the_config_takes_a_ca_file_for_an_https_sidecar_only(host_files: HostFiles, private_ca):
    ca_pem, _ = private_ca
    (host_files.root / "ca.pem").write_text(ca_pem)
    doc = copy.deepcopy(base_document())
    doc["sidecar"].update(url="https://sidecar.internal:8443", ca_file="ca.pem")
    host_files.write(doc)
    assert load_settings(host_files.config, environ={}).sidecars[0].ca_pem == ca_pem
    (host_files.root / "junk.pem").write_text("not a certificate\n")
    for url, ca_file, reason in [
        ("http://127.0.0.1:8090", "ca.pem", "only allowed with an https:// url"),
        ("https://sidecar.internal:8443", "junk.pem", "holds no usable PEM certificate"),
        ("https://sidecar.internal:8443", "missing.pem", "does not exist"),
        ("https://sidecar.internal:8443", ".", "is not a regular file"),
    ]:
        doc["sidecar"].update(url=url, ca_file=ca_file)
        host_files.write(doc)
        with pytest.raises(HostConfigError) as refused:
            load_settings(host_files.config, environ={})
        assert refused.value.key == "sidecar.ca_file" and reason in refused.value.message, refused.value
