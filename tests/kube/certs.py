"""The control plane's PKI, made with `cryptography`, as kubeadm lays it out: a cluster CA,
the API server's serving certificate, client certificates (the admin in system:masters,
the controller manager and the scheduler as their bootstrap RBAC users) and the
service-account signing key pair. Source: Kubernetes' "PKI certificates and requirements"."""
from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=1)  # the certificates of one test session


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


@dataclass(frozen=True)
class Pair:
    """A certificate and its key as PEM files."""
    cert: pathlib.Path
    key: pathlib.Path


class Authority:
    """A self-signed CA that issues the cluster's serving and client certificates."""

    def __init__(self, directory: pathlib.Path, name: str = "kvpilot-test-ca"):
        self.directory = directory
        self.key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pair = self._write("ca", self.cert, self.key)

    def issue(self, file_stem: str, common_name: str, organization: str | None = None,
              server_names: tuple[str, ...] = ()) -> Pair:
        """A certificate for a client (no server_names) or a server (its DNS names and IPs)."""
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (x509.CertificateBuilder().subject_name(_name(common_name, organization))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID_FOR)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server_names:
            builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in server_names]),
                                            critical=False)
        return self._write(file_stem, builder.sign(self.key, hashes.SHA256()), key)

    def service_account_keys(self) -> Pair:
        """The key pair the API server signs and verifies service-account tokens with
        (`cert` holds the public key: --service-account-key-file)."""
        key = _key()
        public = self.directory / "sa.pub"
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
        private = self.directory / "sa.key"
        private.write_bytes(_pem_key(key))
        private.chmod(0o600)
        return Pair(public, private)

    def _write(self, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
        pair = Pair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_pem_key(key))
        pair.key.chmod(0o600)
        return pair


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
