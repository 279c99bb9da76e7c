"""Test certificates and TLS-only ``redis-server`` nodes.

``make_certificates()`` writes a throwaway CA, a server certificate it signed for
127.0.0.1 and localhost, a client certificate for mutual TLS, and a second,
unrelated CA (the "wrong CA"), all with the ``openssl`` command-line tool: nothing
is checked in, and every certificate expires in two days. ``TLSRedisNode`` is a
:class:`harness.nodes.RedisNode` that listens on TLS only (``--port 0``), so a
plaintext client has nothing to fall back to.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from harness.nodes import HOST, RedisNode

__all__ = [
    "Certificates",
    "TLSRedisNode",
    "TLSUnavailableError",
    "make_certificates",
]

# P-256 keys: generating one takes a millisecond, an RSA key far longer.
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
# The key identifiers (and the CA's keyUsage): Python 3.13's default context
# verifies with VERIFY_X509_STRICT, which refuses certificates without them.
_LEAF_EXTENSIONS = """\
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage={usage}
subjectAltName={names}
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
"""


class TLSUnavailableError(RuntimeError):
    """TLS tests cannot run here; the message says what is missing."""


@dataclass(frozen=True)
class Certificates:
    """Paths of the PEM files ``make_certificates()`` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: A CA that signed nothing the server presents.
    wrong_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _ca(directory: Path, name: str, common_name: str) -> None:
    _openssl(
        "req", "-x509", *_KEY, "-days", "2",
        "-keyout", f"{name}.key", "-out", f"{name}.crt",
        "-subj", f"/CN={common_name}",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip


def _leaf(directory: Path, name: str, usage: str, names: str) -> None:
    extensions = directory / f"{name}.ext"
    extensions.write_text(_LEAF_EXTENSIONS.format(usage=usage, names=names))
    _openssl(
        "req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-days", "2",
        "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.crt", "-extfile", extensions.name,
        cwd=directory,
    )  # fmt: skip


def make_certificates(directory: Path) -> Certificates:
    """Write a CA, server and client certificates and a wrong CA into ``directory``.

    Raise ``TLSUnavailableError`` when the ``openssl`` tool is not installed.
    """
    if shutil.which("openssl") is None:
        raise TLSUnavailableError(
            "the openssl command-line tool is not installed (Debian: apt install "
            "openssl); the TLS tests make their certificates with it"
        )
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca", "redlock-django test CA")
    _ca(directory, "wrong-ca", "redlock-django unrelated CA")
    _leaf(directory, "server", "serverAuth", f"IP:{HOST},DNS:localhost")
    _leaf(directory, "client", "clientAuth", "DNS:redlock-client")
    return Certificates(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
        wrong_ca=directory / "wrong-ca.crt",
    )


class TLSRedisNode(RedisNode):
    """A ``redis-server`` that speaks TLS only, with the given certificates.

    ``client_certificates`` makes the server ask every client for a certificate
    signed by the CA (``--tls-auth-clients yes``); otherwise clients need none,
    as with most managed Redis services.
    """

    def __init__(
        self,
        directory: Path | str,
        certificates: Certificates,
        *,
        client_certificates: bool = False,
        server: str | None = None,
    ) -> None:
        super().__init__(directory, server=server)
        self.certificates = certificates
        self.client_certificates = client_certificates

    @property
    def url(self) -> str:
        """Return a ``rediss://`` URL that trusts the test CA (and has a client
        certificate when the server asks for one)."""
        query = f"ssl_ca_certs={self.certificates.ca}"
        if self.client_certificates:
            query += (
                f"&ssl_certfile={self.certificates.client_cert}"
                f"&ssl_keyfile={self.certificates.client_key}"
            )
        return f"rediss://{HOST}:{self.port}/0?{query}"

    def client(self, **overrides: Any) -> redis.Redis:
        """Return a TLS ``redis.Redis`` for assertions, trusting the test CA."""
        options: dict[str, Any] = {
            "ssl": True,
            "ssl_ca_certs": str(self.certificates.ca),
        }
        if self.client_certificates:
            options["ssl_certfile"] = str(self.certificates.client_cert)
            options["ssl_keyfile"] = str(self.certificates.client_key)
        options.update(overrides)
        return super().client(**options)

    def _command(self) -> list[str]:
        command = super()._command()
        # The plaintext port becomes the TLS port; --port 0 turns plaintext off.
        at = command.index("--port")
        command[at : at + 2] = ["--port", "0", "--tls-port", str(self.port)]
        return [
            *command,
            "--tls-cert-file", str(self.certificates.server_cert),
            "--tls-key-file", str(self.certificates.server_key),
            "--tls-ca-cert-file", str(self.certificates.ca),
            "--tls-auth-clients", "yes" if self.client_certificates else "no",
        ]  # fmt: skip
