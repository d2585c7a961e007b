"""AUTH with an identities file made by `tenured hash-secret`, and TLS with certificates made by
the openssl command line (server authentication, then mutual TLS naming an identity)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import tenure
from tenure import Granted, TlsOptions

SECRET = "s3cret with spaces"


def hash_secret(tenured_bin: str, secret: str) -> str:
    out = subprocess.run([tenured_bin, "hash-secret"], input=secret + "\n", capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture
def identities(tenured_bin: str, tmp_path: Path) -> Path:
    path = tmp_path / "identities.toml"
    path.write_text(
        f'[[identity]]\nname = "orders"\nsecret-hash = "{hash_secret(tenured_bin, SECRET)}"\n'
        'prefixes = ["orders/"]\n\n'
        f'[[identity]]\nname = "ops"\nsecret-hash = "{hash_secret(tenured_bin, "ops-secret")}"\n'
        'prefixes = ["*"]\nstats = true\nwatch = true\n'
    )
    return path


def test_auth_with_credentials(start_tenured, identities):
    server = start_tenured("--identities", str(identities))
    with tenure.Client(server.addr, credentials=("orders", SECRET)) as c:
        assert isinstance(c.acquire("orders/1", 10), Granted)
        with pytest.raises(tenure.Forbidden):
            c.acquire("payments/1", 10)
        with pytest.raises(tenure.Forbidden):
            c.stats()
        # Every new connection authenticates again: after a restart the client still works.
        server.restart()
        assert isinstance(c.inspect("orders/1"), tenure.Held)


def test_unauthenticated_and_wrong_secret(start_tenured, identities):
    server = start_tenured("--identities", str(identities))
    with tenure.Client(server.addr) as anonymous:
        assert anonymous.ping() >= 0  # PING needs no identity
        with pytest.raises(tenure.Unauthenticated):
            anonymous.acquire("orders/1", 10)
    with pytest.raises(tenure.Unauthenticated):
        tenure.Client(server.addr, credentials=("orders", "wrong"))
    with pytest.raises(tenure.Unauthenticated):
        tenure.Client(server.addr, credentials=("nobody", SECRET))


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> None:
    """A CA, a server certificate for localhost/127.0.0.1, and a client certificate named
    `orders` (an identity's name), all P-256."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=tenure test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    for name, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("orders", "extendedKeyUsage=clientAuth\n"),
    ):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                f"/CN={'localhost' if name == 'server' else name}", cwd=d)
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n" + ext)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    # A second CA the server's certificate does not come from.
    openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem", "-days", "2", "-subj", "/CN=other CA",
            "-addext", "basicConstraints=critical,CA:TRUE", cwd=d)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    d.mkdir()
    make_certs(d)
    return d


def test_tls_server_authentication(start_tenured, certs):
    server = start_tenured("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"))
    for name in (None, "localhost"):
        with tenure.Client(server.addr, tls=TlsOptions(ca_file=str(certs / "ca.pem"), server_name=name)) as c:
            lease = c.acquire("tls", 10)
            assert isinstance(lease, Granted)
            c.release(lease)
    with pytest.raises(tenure.ConnectionLost):  # a CA that did not sign the server's certificate
        tenure.Client(server.addr, tls=TlsOptions(ca_file=str(certs / "other.pem")))
    with pytest.raises(tenure.ConnectionLost):  # a name the certificate does not carry
        tenure.Client(server.addr, tls=TlsOptions(ca_file=str(certs / "ca.pem"), server_name="elsewhere"))
    with pytest.raises(tenure.HandshakeError, match="requires TLS"):  # plain text to a TLS port
        tenure.Client(server.addr)


def test_mutual_tls_certificate_names_the_identity(start_tenured, certs, identities):
    server = start_tenured(
        "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
        "--tls-client-ca", str(certs / "ca.pem"), "--identities", str(identities),
    )
    tls = TlsOptions(ca_file=str(certs / "ca.pem"), cert_file=str(certs / "orders.pem"), key_file=str(certs / "orders.key"))
    with tenure.Client(server.addr, tls=tls) as c:  # no AUTH: the certificate authenticates
        assert isinstance(c.acquire("orders/7", 10), Granted)
        with pytest.raises(tenure.Forbidden):
            c.acquire("other/7", 10)
    # AUTH as the certificate's own identity is answered AUTHENTICATED too.
    with tenure.Client(server.addr, tls=tls, credentials=("orders", SECRET)) as c:
        assert isinstance(c.acquire("orders/8", 10), Granted)


def test_auth_answered_not_leader_by_a_follower_goes_to_the_leader(start_tenured, identities):
    """A follower that answers the AUTH itself with NOT_LEADER: the client connects to the
    leader it names and authenticates there."""
    import asyncio

    from test_cluster import FakeFollower

    server = start_tenured("--identities", str(identities))

    async def main():
        follower = await FakeFollower(server.addr).start()
        async with tenure.AsyncClient(f"{follower.addr},{follower.addr}", credentials=("orders", SECRET)) as c:
            assert isinstance(await c.acquire("orders/9", 10), Granted)
        assert follower.requests == [0x0A]  # one AUTH, nothing else
        follower.server.close()

    asyncio.run(main())
