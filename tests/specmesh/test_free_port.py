"""``specmesh.deploy.free_port``: ports a service binds seconds later, kept out of the kernel's ephemeral
range, where outgoing connections and listeners on port 0 (gloo's ranks, gRPC) would take them."""

import socket

from specmesh import deploy


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    start = deploy._ephemeral_start()
    ports = {deploy.free_port() for _ in range(20)}
    assert len(ports) >= 18  # random, not the same port handed out again and again
    for port in ports:
        assert deploy.PORTS_BELOW_EPHEMERAL[0] <= port < min(start, deploy.PORTS_BELOW_EPHEMERAL[1])
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(deploy, "PORTS_BELOW_EPHEMERAL", (taken, taken + 1))
        monkeypatch.setattr(deploy, "_ephemeral_start", lambda: taken + 1)
        port = deploy.free_port()  # the one candidate is taken: the kernel's choice instead
        assert port != taken
