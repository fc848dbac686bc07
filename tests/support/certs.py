"""Throwaway certificate authorities for TLS tests (openssl): a CA and a node certificate it signed,
naming 127.0.0.1 and localhost, as an operator's private CA would issue them."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeCert:
    cert: str
    key: str
    ca: str

    def transport(self) -> dict:
        """The deployment's `transport` keys that select these files."""
        return {"tls_cert": self.cert, "tls_key": self.key, "tls_ca": self.ca}


def make_node_cert(directory: Path, ca_name: str = "prfaas-test-ca") -> NodeCert:
    directory.mkdir(parents=True, exist_ok=True)

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", f"/CN={ca_name}")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "1", "-extfile", "san.cnf")
    return NodeCert(str(directory / "node.pem"), str(directory / "node.key"), str(directory / "ca.pem"))
