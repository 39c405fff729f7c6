"""angpt.training.distributed.free_port: the port a one-process job (and the tests' launches) binds its store to,
picked below the kernel's ephemeral range, whose released ports outgoing connections may take (EADDRINUSE)."""

import socket

import pytest

from angpt.training import distributed


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            return int(file.read().split()[0])
    except OSError:
        return 32768


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    ports = {distributed.free_port() for _ in range(20)}
    assert len(ports) > 1 and all(1024 <= port < ephemeral_low() for port in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


class Candidates:
    """random.Random's stand-in: its sample is the given ports."""

    def __init__(self, ports):
        self.ports = ports

    def __call__(self):
        return self

    def sample(self, population, count):
        assert count == 100 and all(port in population for port in self.ports)
        return self.ports


def test_a_taken_port_is_passed_over_and_none_free_is_one_line(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", distributed.free_port()))
        busy = taken.getsockname()[1]
        free = distributed.free_port()
        monkeypatch.setattr(distributed.random, "Random", Candidates([busy, free]))
        assert distributed.free_port() == free
        monkeypatch.setattr(distributed.random, "Random", Candidates([busy] * 100))
        with pytest.raises(RuntimeError, match=r"^no free TCP port in 100 tries below \d+$"):
            distributed.free_port()
