"""Issue 34 input 10: the harnesses' one port chooser never hands out the same
port twice in one process (binding port 0 and closing can return the port
just closed; etcd's peer and metrics URLs once got the same one)."""

from __future__ import annotations

from tests.helpers import free_port


def test_no_port_is_handed_out_twice_in_one_process() -> None:
    sets = [(free_port(), free_port(), free_port()) for _ in range(2000)]
    ports = [p for s in sets for p in s]
    assert len(ports) == len(set(ports)) == 6000
    assert all(len(set(s)) == 3 for s in sets)
