"""The workers' store, locked down (issue 27 item 2).

Before: the generation's TCPStore listened on every interface, ``--standalone`` included, and a client with
no credentials, from another host, listed its keys and wrote one; that store tells every rank where its gloo
peers are when a world (re-)forms, so whoever can write it can put itself between two ranks.

Now (tpassrun.store): one port on the advertised address (loopback for a single node); tpassrun's workers form
their worlds through an authenticated door (the run's store key proved, every message tagged) into a store no
other path reaches; plain TCPStore clients (env:// scripts) are relayed to a separate loopback-only TCPStore.
The pyramid: the key-value semantics and the wire pure or in one process, the door against real torch
clients, the store process as the agent starts it, and a second host in its own network namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tpassrun.store import bind_host, derive_store_key, serve, wire
from tpassrun.store.client import AuthStore
from tpassrun.store.server import KeyValue, StoreTimeout

pytestmark = pytest.mark.timeout(300)

KEY = derive_store_key(b"m" * 32)
SHORT = timedelta(seconds=2)


# --- pure: TCPStore's semantics, the wire ---------------------------------------------------------------
def test_key_value_has_tcpstores_semantics():
    kv = KeyValue()
    assert kv.apply(wire.ADD, [b"n", b"3"], 0) == [b"3"]
    assert kv.apply(wire.ADD, [b"n", b"-1"], 0) == [b"2"]
    assert kv.apply(wire.COMPARE_SET, [b"c", b"x", b"y"], 0) == [b"x"]       # absent, expected not empty
    assert kv.apply(wire.COMPARE_SET, [b"c", b"", b"y"], 0) == [b"y"]        # absent, expected empty: set
    assert kv.apply(wire.COMPARE_SET, [b"c", b"z", b"w"], 0) == [b"y"]       # present, mismatch: current
    assert kv.apply(wire.COMPARE_SET, [b"c", b"y", b"w"], 0) == [b"w"]
    kv.apply(wire.APPEND, [b"a", b"1"], 0)
    kv.apply(wire.APPEND, [b"a", b"2"], 0)
    kv.apply(wire.MULTI_SET, [b"p", b"q", b"P", b"Q"], 0)
    assert kv.apply(wire.MULTI_GET, [b"a", b"p", b"q"], 1) == [b"12", b"P", b"Q"]
    assert kv.apply(wire.CHECK, [b"p", b"missing"], 0) == [b"0"]
    assert kv.apply(wire.DELETE, [b"p"], 0) == [b"1"] and kv.apply(wire.DELETE, [b"p"], 0) == [b"0"]
    with pytest.raises(StoreTimeout):
        kv.apply(wire.GET, [b"never"], 0.05)
    later = threading.Timer(0.05, lambda: kv.apply(wire.SET, [b"late", b"v"], 0))
    later.start()
    assert kv.apply(wire.GET, [b"late"], 5) == [b"v"]


def test_a_message_replayed_reflected_or_altered_is_refused():
    a, b = socket.socketpair()
    key = b"k" * 32
    client, server = wire.Channel(a, key, b"c"), wire.Channel(b, key, b"s")
    client.send(wire.encode_op(wire.SET, [b"x", b"1"]))
    assert wire.decode_op(server.recv()) == (wire.SET, 0, [b"x", b"1"])
    frame = wire._LEN.pack(len(body := wire.encode_op(wire.SET, [b"x", b"2"]))) + body
    tag = client._tag(b"c", 1, body)
    a.sendall(frame + tag)
    server.recv()                                    # the genuine second message
    a.sendall(frame + tag)                           # ... played again
    with pytest.raises(wire.AuthError):
        server.recv()
    c2, s2 = socket.socketpair()
    reflected = wire.Channel(s2, key, b"s")
    reflected.send(wire.encode_answer(wire.OK, []))
    with pytest.raises(wire.AuthError):              # the server's own message sent back to it
        wire.Channel(c2, key, b"s").recv()
    for s in (a, b, c2, s2):
        s.close()


def test_a_single_nodes_store_listens_on_loopback_and_a_jobs_on_its_address():
    assert bind_host("localhost", single_node=True) in ("127.0.0.1", "::1")
    assert bind_host("192.0.2.77", single_node=True) == "127.0.0.1"    # a node's own address: still loopback
    assert bind_host("192.0.2.77", single_node=False) == "192.0.2.77"   # never 0.0.0.0
    assert bind_host("localhost", single_node=False) == "127.0.0.1"     # --local-addr 127.0.0.1: as named
    # the FQDN default resolving here to loopback only (Debian's 127.0.1.1) while the peers resolve it to this
    # node's address: every interface, as torchrun, rather than a store no peer can reach
    assert bind_host("localhost", single_node=False, named=False) in ("::", "0.0.0.0")


# --- the doors, against real torch clients ---------------------------------------------------------------
@pytest.fixture
def store_server():
    server = serve("127.0.0.1", 0, KEY)
    yield server
    server.close()


def test_a_client_without_the_key_can_neither_read_nor_write_the_worlds_keys(store_server):
    port = store_server.port
    assert store_server._listener.getsockname()[0] == "127.0.0.1"
    ours = AuthStore("127.0.0.1", port, KEY, SHORT)
    ours.set("world/0/addr", b"10.0.0.5:4242")
    assert ours.add("arrived", 1) == 1

    with pytest.raises(dist.DistStoreError, match="refused the run's key"):
        AuthStore("127.0.0.1", port, derive_store_key(b"other" * 8), SHORT)

    # torch's own client, as a stranger would use it: it reaches the plain door, a different store
    plain = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SHORT)
    assert not plain.check(["world/0/addr"])
    with pytest.raises(dist.DistStoreError):
        plain.get("world/0/addr")
    plain.set("world/0/addr", b"6.6.6.6:666")
    plain.add("arrived", 5)
    assert ours.get("world/0/addr") == b"10.0.0.5:4242"
    assert ours.add("arrived", 0) == 1
    assert ours.num_keys() == 2


def test_without_the_plain_door_a_tcpstore_client_gets_nothing():
    server = serve("127.0.0.1", 0, KEY, plain=False)
    try:
        with pytest.raises((dist.DistNetworkError, dist.DistStoreError, RuntimeError)):
            dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=SHORT)
        assert AuthStore("127.0.0.1", server.port, KEY, SHORT).check([]) is True
    finally:
        server.close()


def test_strangers_dripping_into_the_store_never_hold_a_worker_back(store_server):
    port = store_server.port
    drips = []
    for first in (wire.MAGIC[:2], wire.MAGIC, b"\x00"):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(first)
        drips.append(s)
    ours = AuthStore("127.0.0.1", port, KEY, SHORT)
    ours.set("k", b"v")
    assert ours.get("k") == b"v"
    for s in drips:
        s.close()


def test_the_authenticated_door_serves_while_the_plain_doors_tcpstore_is_still_starting():
    """The plain door's TCPStore needs torch (a 1-3 s import in a fresh store process): a store started because
    the node that ran the workers' store was lost must not make the re-formed world wait for it. Key holders are
    served at once; a plain client that arrives meanwhile waits for the TCPStore, then is relayed to it."""
    from tpassrun.store.server import StoreServer, loopback_tcpstore

    release = threading.Event()

    def slow_tcpstore():
        release.wait(30)
        return loopback_tcpstore()

    server = StoreServer("127.0.0.1", 0, KEY, plain_store=slow_tcpstore)
    server.start()
    try:
        ours = AuthStore("127.0.0.1", server.port, KEY, SHORT)
        ours.set("world/0/addr", b"10.0.0.5:4242")
        assert ours.get("world/0/addr") == b"10.0.0.5:4242" and not server.plain_ready(0)
        got: dict[str, object] = {}

        def plain_client():
            plain = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
            plain.set("p", b"1")
            got["p"] = plain.get("p")

        t = threading.Thread(target=plain_client)
        t.start()
        release.set()
        t.join(60)
        assert got == {"p": b"1"} and server.plain_ready(0)
        assert not ours.check(["p"])          # still two separate stores
    finally:
        server.close()


# --- the store process, as the agent starts it ------------------------------------------------------------
def test_the_store_process_takes_its_key_on_stdin_and_serves_a_key_holder():
    """As the agent starts it (the gloo worlds through it: every e2e job; --no-plain: no torch to import)."""
    proc = subprocess.Popen([sys.executable, "-m", "tpassrun.launch.storeserver", "127.0.0.1", "0", "--no-plain"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(KEY.hex() + "\n")
        proc.stdin.close()
        port = int(proc.stdout.readline().split()[1])
        assert KEY.hex() not in " ".join(proc.args)
        store = AuthStore("127.0.0.1", port, KEY, timedelta(seconds=60))
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.compare_set("k", b"v", b"w") == b"w"
        with pytest.raises(dist.DistStoreError):
            AuthStore("127.0.0.1", port, derive_store_key(b"x" * 32), SHORT)
    finally:
        proc.kill()
        proc.wait()


def test_a_standby_store_listens_without_torch_and_takes_over_at_once(tmp_path):
    """Issue 37: every agent but the store's keeps a standby store (WorkersStore.standby); the recovery's leader
    makes it the re-formed world's (host_new): the same port its store_standby event said, serving a key holder at
    once, with no torch imported; a plain client opens the plain door on demand (torch imported then)."""
    import asyncio
    import types

    from tpassrun.agent.store import WorkersStore

    said: list[tuple[str, dict]] = []
    state = types.SimpleNamespace(
        cfg=types.SimpleNamespace(max_nodes=2, rdzv_backend="etcd", local_addr="127.0.0.1", python_exec=sys.executable),
        store_host="the-lost-node", node_id="this-node",
        events=types.SimpleNamespace(write=lambda name, **fields: said.append((name, fields))))
    node = types.SimpleNamespace(mirror=types.SimpleNamespace(key=b"m" * 32))

    def torch_loaded(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as fh:
            return "libtorch" in fh.read()

    async def main() -> None:
        ws = WorkersStore(state, node)
        try:
            await ws.standby()
            await ws.standby()                       # one standby, however often a failure asks for it
            [(name, fields)] = said
            assert name == "store_standby"
            addr, port = await ws.host_new()
            assert (addr, port) == ("127.0.0.1", fields["port"]) and await ws.ready(60)
            ours = AuthStore(addr, port, KEY, SHORT)
            ours.set("world/1/addr", b"10.0.0.5:4242")
            assert ours.get("world/1/addr") == b"10.0.0.5:4242"
            assert not torch_loaded(fields["pid"])
            plain = await asyncio.to_thread(dist.TCPStore, addr, port, is_master=False, timeout=timedelta(seconds=60))
            plain.set("p", b"1")
            assert plain.get("p") == b"1" and not ours.check(["p"]) and torch_loaded(fields["pid"])
        finally:
            await ws.stop()

    asyncio.run(main())


# --- another host: a network namespace on a veth pair -----------------------------------------------------
_PROBE = r"""
import json, sys
from datetime import timedelta
import torch.distributed as dist
from tpassrun.store.client import AuthStore
host, port, good, bad = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), bytes.fromhex(sys.argv[4])
out = {}
try:
    AuthStore(host, port, bad, timedelta(seconds=3))
    out["wrong_key"] = "accepted"
except dist.DistStoreError as exc:
    out["wrong_key"] = "refused"
plain = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
out["plain_sees"] = plain.check(["world/0/addr"])
plain.set("world/0/addr", b"6.6.6.6:666")
out["good"] = AuthStore(host, port, good, timedelta(seconds=10)).get("world/0/addr").decode()
print(json.dumps(out))
"""


def _netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"s27p{os.getpid() % 100000}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.mark.skipif(not _netns_available(), reason="needs root and `ip netns` (a second host on a veth pair)")
def test_from_another_host_a_stranger_is_refused_and_a_key_holder_served():
    tag = os.getpid() % 100000
    ns, host_if, ns_if = f"s27n{tag}", f"s27a{tag}", f"s27b{tag}"
    octet = 100 + tag % 100
    here, there = f"10.{octet}.27.1", f"10.{octet}.27.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    server = None
    try:
        ip("netns", "add", ns)
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{here}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", ns, "addr", "add", f"{there}/30", "dev", ns_if)
        ip("-n", ns, "link", "set", ns_if, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        loopback = serve(bind_host("localhost", single_node=True), 0, KEY)   # a single node's: not reachable
        server = serve(bind_host(here, single_node=False), 0, KEY)
        AuthStore(here, server.port, KEY, SHORT).set("world/0/addr", b"10.0.0.5:4242")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()   # not every interface
        probe = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _PROBE, here, str(server.port),
                                KEY.hex(), derive_store_key(b"x" * 32).hex()],
                               capture_output=True, text=True, timeout=240)
        assert probe.returncode == 0, probe.stderr[-2000:]
        got = json.loads(probe.stdout.strip().splitlines()[-1])
        assert got == {"wrong_key": "refused", "plain_sees": False, "good": "10.0.0.5:4242"}
        reach = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 2)",
                                here, str(loopback.port)], capture_output=True, timeout=60)
        assert reach.returncode != 0         # the single node's store is not on the host's address
        loopback.close()
    finally:
        if server is not None:
            server.close()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
