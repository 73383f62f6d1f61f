"""The etcd an agent hosts for a c10d/static endpoint honours the job's ``cacert``/``cert``/``key``: it serves TLS
only, and only to clients whose certificate the job's CA signed. Certificates are made here with the openssl CLI
(a throw-away CA, a node certificate for 127.0.0.1/localhost usable as server and client, and a stranger's
certificate from another CA)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys

import pytest
from faults import EXAMPLE, Job

from tpassrun.rendezvous import (
    EmbeddedEtcd,
    EtcdConfig,
    EtcdStore,
    RendezvousConnectionError,
    RendezvousError,
    ServerTls,
    find_etcd_binary,
)

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")]


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: str, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def _leaf(d: str, name: str, ca: str) -> None:
    with open(os.path.join(d, f"{name}.ext"), "w") as fh:
        fh.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    _ca(d, "ca")
    _leaf(d, "node", "ca")
    _ca(d, "other-ca")
    _leaf(d, "stranger", "other-ca")
    return {name: os.path.join(d, name) for name in ("ca", "node", "stranger", "other-ca")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _roundtrip(endpoint: str, conf: dict[str, str]) -> dict | None:
    async with EtcdStore(EtcdConfig.from_endpoint(endpoint, {"read_timeout": "2", **conf})) as store:
        await store.put_json("/tls-check", {"v": 1, "ok": True})
        value, _ = await store.get_json("/tls-check")
        return value


def test_the_hosted_etcd_serves_tls_only_to_clients_of_the_jobs_ca(pki):
    node = {"cacert": pki["ca"] + ".pem", "cert": pki["node"] + ".pem", "key": pki["node"] + ".key"}
    tls = ServerTls.for_hosting(node, cacert=node["cacert"], cert=node["cert"], key=node["key"], tls=True)

    async def main():
        port = _free_port()
        async with EmbeddedEtcd(find_etcd_binary(), client_port=port, advertise_host="127.0.0.1", tls=tls) as etcd:
            endpoint = etcd.endpoint
            assert await _roundtrip(endpoint, node) == {"v": 1, "ok": True}
            refused = {
                "plain HTTP": {},
                "TLS without a client certificate": {"cacert": node["cacert"]},
                "a certificate of another CA": {"cacert": node["cacert"], "cert": pki["stranger"] + ".pem",
                                                "key": pki["stranger"] + ".key"},
            }
            for what, conf in refused.items():
                with pytest.raises(RendezvousConnectionError, match="cannot reach etcd"):
                    await _roundtrip(endpoint, conf)
                print(f"refused: {what}")
    asyncio.run(main())


def test_hosting_tls_without_a_server_certificate_is_a_one_line_error(pki):
    with pytest.raises(RendezvousError, match="needs a server certificate"):
        ServerTls.for_hosting({}, cacert=pki["ca"] + ".pem", cert=None, key=None, tls=True)
    assert ServerTls.for_hosting({}, cacert=None, cert=None, key=None, tls=False) is None
    split = ServerTls.for_hosting({"server_cert": pki["node"] + ".pem", "server_key": pki["node"] + ".key"},
                                  cacert=pki["ca"] + ".pem", cert=None, key=None, tls=True)
    assert split.cert.endswith("node.pem") and split.client_cert is None


@pytest.mark.e2e
def test_a_c10d_job_that_asks_for_tls_starts_and_finishes(tmp_path, pki, run_id):
    """torchrun's c10d command line plus TLS in --rdzv-conf: the agent on the endpoint hosts a TLS etcd and the
    job runs to the end (before: the hosted etcd spoke plain HTTP and a job that asked for TLS could not start)."""
    out = str(tmp_path)
    conf = f"cacert={pki['ca']}.pem,cert={pki['node']}.pem,key={pki['node']}.key,read_timeout=10"
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", run_id, "--rdzv-conf", conf,
            "--log-dir", os.path.join(out, "logs"), EXAMPLE, "--steps", "5", "--step-sleep", "0", "--out", out,
            "--quiet"]
    job = Job(argv=argv, out=out).start()
    try:
        assert job.wait(90) == 0, job.log()[-3000:]
    finally:
        job.kill()
    assert "etcd_hosted" in [e["event"] for e in job.events()]
    assert [x["step"] for x in job.losses(0)] == list(range(5))
