"""A finishing trainer waits for the operator's read of its final metrics, not for anyone's."""
import threading
import time
import urllib.request

import pytest

from kubetune_api.contract import OPERATOR_READ_QUERY
from kubetune_trainer.telemetry.metrics import TrainerMetrics


@pytest.fixture
def metrics():
    served = TrainerMetrics("team-a", "sd15", port=0, addr="127.0.0.1")
    yield served
    served.server.close()


def read(metrics, query: str = "") -> str:
    url = f"http://127.0.0.1:{metrics.server.port}/metrics" + (f"?{query}" if query else "")
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def waiting(metrics, timeout: float) -> tuple[threading.Thread, list]:
    result = []
    thread = threading.Thread(target=lambda: result.append(metrics.server.wait_for_operator_read(timeout)))
    thread.start()
    time.sleep(0.2)  # the wait has begun
    return thread, result


def test_only_an_operator_read_begun_after_the_wait_ends_it(metrics):
    read(metrics, OPERATOR_READ_QUERY)  # before the final values: does not count
    thread, result = waiting(metrics, timeout=30)
    assert "kubetune_trainer_step" in read(metrics), "Prometheus' scrape is answered as before"
    thread.join(0.5)
    assert thread.is_alive(), "a Prometheus scrape does not end the wait"
    metrics.step.set(30)
    assert 'kubetune_trainer_step{trainingjob="sd15",trainingjob_namespace="team-a"} 30.0' in \
        read(metrics, OPERATOR_READ_QUERY)
    thread.join(5)
    assert result == [True]


def test_without_the_operators_read_the_wait_gives_up_after_its_time(metrics):
    started = time.monotonic()
    assert metrics.server.wait_for_operator_read(0.5) is False
    assert 0.5 <= time.monotonic() - started < 5


def test_the_operators_progress_read_is_marked_as_its_own(metrics):
    from kubetune_operator.kube import read_trainer_gauges

    thread, result = waiting(metrics, timeout=30)
    metrics.step.set(7)
    assert read_trainer_gauges("127.0.0.1", metrics.server.port)["step"] == 7
    thread.join(5)
    assert result == [True]


def test_the_final_report_holds_what_the_operators_read_would_have(metrics):
    """The termination message is the read that comes too late: the same gauges, under the same names."""
    from kubetune_api.contract import final_report, read_final_report
    from kubetune_operator.kube import read_trainer_gauges

    metrics.step.set(60)
    metrics.loss(0.125)
    metrics.validation(60, {"loss": 0.5})
    assert read_final_report(final_report(metrics.readings())) == read_trainer_gauges("127.0.0.1", metrics.server.port)


def test_a_finished_trainer_leaves_its_final_report_where_the_kubelet_keeps_it(tmp_path, monkeypatch):
    from kubetune_api.contract import TrainerEnv, read_final_report
    from kubetune_trainer.telemetry.reporting import Reporter

    reporter = Reporter(True, total_steps=10, start_step=0, log_dir=None, log_every=1, samples_per_step=4,
                        namespace="team-a", job_name="demo")
    reporter.step(10, loss=0.25, lr=1e-4, epoch=0)
    termination_log = tmp_path / "termination-log"
    assert reporter.write_final_report(termination_log) is False, "outside a pod (no file made for it): nothing"
    assert not termination_log.exists()
    termination_log.touch()  # what the kubelet makes for a container
    monkeypatch.delenv(TrainerEnv.NAMES["pod_name"], raising=False)
    assert reporter.write_final_report(termination_log) is False, "a file there, but not the operator's pod"
    assert termination_log.read_text() == ""
    monkeypatch.setenv(TrainerEnv.NAMES["pod_name"], "demo-master-0")  # the downward API, in its pods
    assert reporter.write_final_report(termination_log) is True
    report = read_final_report(termination_log.read_text())
    assert report["step"] == 10 and report["planned_steps"] == 10 and report["loss"] == 0.25
    reporter.close()
