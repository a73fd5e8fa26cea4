"""Listen ports (the local control plane's, the trainer's rendezvous port, the tests' servers) come
from below the kernel's ephemeral range, where no outgoing connection can take them between their
choice and their bind."""
import socket

import pytest

from kubetune_api.ports import ephemeral_ports, free_listen_port
from kubetune_dev.cluster import PORT_NAMES, Cluster


def test_the_ephemeral_range_is_read_from_the_kernels_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ephemeral_ports(setting) == range(40000, 50001)
    assert ephemeral_ports(tmp_path / "absent") == range(32768, 61000), "Linux's default"


def test_a_chosen_port_is_below_the_range_and_free():
    ephemeral = range(30000, 60000)
    port = free_listen_port(ephemeral)
    assert 10000 <= port < 30000
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_range_with_nothing_below_it_is_refused_with_its_bounds():
    with pytest.raises(RuntimeError, match="no free port in 1024-1099"):
        free_listen_port(range(1100, 60000), tries=0)


def test_a_new_control_plane_gets_distinct_ports_outside_the_ephemeral_range(tmp_path):
    ports = Cluster(home=tmp_path).ports
    assert set(ports) == set(PORT_NAMES)
    assert len(set(ports.values())) == len(ports)
    assert not set(ports.values()) & set(ephemeral_ports())
    assert Cluster(home=tmp_path).ports == ports, "chosen once, kept"


def test_a_port_already_chosen_for_another_component_is_not_chosen_again():
    ephemeral = range(1034, 60000)  # ten candidates: 1024-1033
    taken = set(range(1024, 1033))
    assert free_listen_port(ephemeral, taken=taken) == 1033


def test_the_trainers_launcher_takes_its_rendezvous_port_from_below_the_range(monkeypatch, example_manifest):
    from kubetune_trainer.process import start

    chosen = []
    monkeypatch.setattr(start, "launch", lambda command, place, env: chosen.append(place.master_port) or 0)
    assert start.launch_local(start.TrainingJob.model_validate(example_manifest), nproc=2) == 0
    assert len(chosen) == 1 and chosen[0] < ephemeral_ports().start
