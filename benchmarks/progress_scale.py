"""Progress of 1,000 running jobs, read by one operator process: today's poll against a push.

    .venv/bin/python benchmarks/progress_scale.py                       # 1,000 jobs, 10 s interval, both ways
    .venv/bin/python benchmarks/progress_scale.py --jobs 200 --interval 2 --intervals 5 --way poll

A thousand trainers cannot run on one small machine, so one stand-in process (started by this
script) plays all of them: it serves N rank-0 /metrics endpoints, each on its own loopback address
as every pod has one here (127.77.x.y, the trainer metrics port), with the body a real trainer
serves (kubetune_trainer.telemetry.metrics, every gauge set), its step advancing once a second. The step a
reading carries says when that value was set, so the age of what the operator shows is known.

The operator's side runs in this process, with what the operator runs:
  * poll (today): every interval, each job's read, kubetune_operator.kube.read_trainer_gauges (an
    HTTP GET of /metrics and the Prometheus text parsed), then status.status_from_metrics, on a pool
    of 16 threads (kopf's executor in handlers.configure), the N reads spread over the interval as
    kopf's per-job timers are;
  * push: each stand-in trainer POSTs its gauges (contract.final_report's JSON) once per interval,
    from its own address, to the operator's progress inbox (kubetune_operator.progress_inbox on
    aiohttp, accepting a job's pushes from its rank-0 pod's address only); the operator keeps the
    newest per job and builds the same status fields from it.
Measured: the operator process's CPU seconds per running job per interval (process CPU time over
the measured intervals, all threads), and the age of each job's shown progress just before it is
next replaced (p50/p99, in intervals; target p99 ≤ 2). Then, for the poll only, the CPU of
finding the pod to read (kube.trainer_pods: a LIST per job per interval, its answer decoded by the
Kubernetes client; a push needs none). Not included, the same for both ways: the rest of each job's
timer reconcile (reads of the TrainingJob, child and ConfigMap, the status patch).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PORT = 9400  # the trainer metrics port the chart sets (operator.trainerMetricsPort)
OPERATOR_PUSH_PORT = 9444
STEP_SECONDS = 1.0  # the stand-in trainers advance one step a second
SENTINEL = 424242.0  # the step in the body's template, replaced by each job's current step


def address(index: int) -> str:
    return f"127.77.{index // 250}.{index % 250 + 1}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---- the stand-in: N trainers in one process ------------------------------------------------------------

def metrics_body() -> bytes:
    """What a real rank-0 trainer serves mid-run (every gauge set), with the step as SENTINEL."""
    from prometheus_client import generate_latest

    from kubetune_trainer.telemetry.metrics import TrainerMetrics

    metrics = TrainerMetrics("team-a", "sd15-lora", port=None)
    metrics.planned_steps.set(10_000)
    metrics.step.set(SENTINEL)
    metrics.loss(0.1234)
    metrics.eta_seconds.set(3600)
    metrics.run_version.set(0)
    metrics.last_checkpoint_step.set(500)
    metrics.validation(500, {"loss": 0.2})
    metrics.pods(["sd15-lora-node-0-0"])
    return generate_latest(metrics.registry)


def current_step(started: float) -> int:
    return int((time.time() - started) / STEP_SECONDS)


async def serve(jobs: int, started: float, way: str, interval: float) -> None:
    template = metrics_body()
    sentinel = f" {SENTINEL}\n".encode()
    assert template.count(sentinel) == 1, "the step's line is found in the body"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            body = template.replace(sentinel, f" {current_step(started)}.0\n".encode())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(answer, address(i), PORT, backlog=64) for i in range(jobs)]
    print("ready", flush=True)
    if way == "push":
        import aiohttp

        from kubetune_api.contract import final_report

        async def push(index: int, session: aiohttp.ClientSession) -> None:
            await asyncio.sleep(interval * index / jobs)  # trainers started at different times
            while True:
                gauges = {"step": current_step(started), "planned_steps": 10_000, "loss": 0.1234, "eta_seconds": 3600,
                          "run_version": 0, "last_checkpoint_step": 500, "validation_step": 500, "validation_loss": 0.2}
                try:
                    async with session.post(f"http://127.0.0.1:{OPERATOR_PUSH_PORT}/progress/team-a/job-{index}",
                                            data=final_report(gauges), headers={"Content-Type": "application/json"}):
                        pass
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(interval)

        # Each trainer pushes from its own pod address, as a pod does (the inbox checks the sender).
        sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, local_addr=(address(i), 0)))
                    for i in range(jobs)]
        try:
            await asyncio.gather(*(push(i, session) for i, session in enumerate(sessions)))
        finally:
            await asyncio.gather(*(session.close() for session in sessions))
    else:
        await asyncio.gather(*(s.serve_forever() for s in servers))


# ---- the operator's side -----------------------------------------------------------------------------------

def poll(jobs: int, interval: float, intervals: int, started: float) -> tuple[float, list[float], int]:
    """Today's way: each job's gauges read over HTTP once per interval, on kopf's 16 threads."""
    from kubetune_operator import status
    from kubetune_operator.kube import read_trainer_gauges

    shown: dict[int, list[tuple[float, float]]] = {i: [] for i in range(jobs)}  # job -> (shown at, value set at)
    failures = [0]

    def look(index: int) -> None:
        try:
            gauges = read_trainer_gauges(address(index), PORT)
        except OSError:
            failures[0] += 1
            return
        status.status_from_metrics(gauges, "s3://bucket/runs", "team-a", f"job-{index}")
        shown[index].append((time.time(), started + gauges["step"] * STEP_SECONDS))

    with ThreadPoolExecutor(16) as pool:
        begin, cpu = time.monotonic(), time.process_time()
        for tick in range(intervals):
            for index in range(jobs):  # kopf's timers: each job's own, spread over the interval
                due = begin + tick * interval + interval * index / jobs
                time.sleep(max(0.0, due - time.monotonic()))
                pool.submit(look, index)
        pool.shutdown(wait=True)
        used = time.process_time() - cpu
    return used, ages(shown), failures[0]


def push(jobs: int, interval: float, intervals: int, started: float) -> tuple[float, list[float], int]:
    """The push: each trainer POSTs its gauges once per interval to the operator's progress inbox
    (kubetune_operator.progress_inbox: the sender checked against the job's rank-0 pod address, the
    newest gauges kept), then status.status_from_metrics of what it kept."""
    from aiohttp import web

    from kubetune_operator import status
    from kubetune_operator.progress_inbox import ProgressInbox

    shown: dict[str, list[tuple[float, float]]] = {}
    failures = [0]
    # The rank-0 pod's address, looked up once per job (the operator's is a LIST of its pods).
    inbox = ProgressInbox(lambda namespace, name: {address(int(name.removeprefix("job-")))}, interval)

    async def progress(request: web.Request) -> web.Response:
        answer = await inbox.handle(request)
        namespace, name = request.match_info["namespace"], request.match_info["job"]
        gauges = inbox.fresh(namespace, name) if answer.status == 204 else None
        if gauges is None:
            failures[0] += 1
            return answer
        status.status_from_metrics(gauges, "s3://bucket/runs", namespace, name)
        shown.setdefault(name, []).append((time.time(), started + gauges["step"] * STEP_SECONDS))
        return answer

    async def run() -> float:
        app = web.Application()
        app.router.add_post("/progress/{namespace}/{job}", progress)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", OPERATOR_PUSH_PORT).start()
        await asyncio.sleep(interval)  # every trainer has begun pushing
        shown.clear()
        cpu = time.process_time()
        await asyncio.sleep(interval * intervals)
        used = time.process_time() - cpu
        await runner.cleanup()
        return used

    used = asyncio.run(run())
    return used, ages(shown), failures[0]


def pod_lookup_cpu(calls: int = 300) -> float:
    """CPU seconds of the poll's other per-job step, kube.trainer_pods: the API server's answer to a
    LIST of the job's rank-0 pod, decoded by the Kubernetes client as the operator does (the pod is
    the one the operator renders for a PyTorchJob master, Running; the API server's own work is not
    counted)."""
    import yaml
    from kubernetes.client import ApiClient

    from kubetune_api.spec import TrainingJob
    from kubetune_operator.backends import BACKENDS
    from kubetune_operator.settings import Settings

    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "sd15-lora.yaml").read_text())
    job = TrainingJob.model_validate({**manifest, "metadata": {"name": "sd15-lora", "namespace": "team-a"}})
    child = BACKENDS["pytorchjob"].build(job, "uid-1", Settings(backend="pytorchjob", backends=("pytorchjob",)))
    template = child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
           "metadata": {**template["metadata"], "name": "sd15-lora-master-0", "namespace": "team-a",
                        "uid": "pod-uid", "resourceVersion": "12345", "creationTimestamp": "2026-11-27T12:00:00Z"},
           "status": {"phase": "Running", "podIP": "127.77.0.1", "startTime": "2026-11-27T12:00:01Z",
                      "conditions": [{"type": t, "status": "True", "lastTransitionTime": "2026-11-27T12:00:02Z"}
                                     for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                      "containerStatuses": [{"name": c["name"], "image": c["image"], "imageID": "", "ready": True,
                                             "restartCount": 0, "started": True,
                                             "state": {"running": {"startedAt": "2026-11-27T12:00:02Z"}}}
                                            for c in template["spec"]["containers"]]}}
    answer = type("Answer", (), {"data": json.dumps({"apiVersion": "v1", "kind": "PodList", "items": [pod],
                                                     "metadata": {"resourceVersion": "12346"}})})()
    client = ApiClient()
    cpu = time.process_time()
    for _ in range(calls):
        client.deserialize(answer, "V1PodList")
    return (time.process_time() - cpu) / calls


def ages(shown: dict) -> list[float]:
    """For each job, how old its shown progress was just before the next reading replaced it."""
    result = []
    for readings in shown.values():
        for (_, value_set), (next_shown, _) in zip(readings, readings[1:]):
            result.append(next_shown - value_set)
    return result


def measure(way: str, jobs: int, interval: float, intervals: int) -> None:
    started = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p / "src") for p in (
        "api", "operator", "trainer_image")) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    stand_in = subprocess.Popen([sys.executable, __file__, "--serve", str(jobs), "--way", way, "--interval",
                                 str(interval), "--started", repr(started)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert stand_in.stdout.readline().strip() == "ready", "the stand-in trainers did not start"
        load = os.getloadavg()[0]
        used, age, failures = (poll if way == "poll" else push)(jobs, interval, intervals, started)
        per_job = used / (jobs * intervals)
        print(f"{way:4s}  {jobs} jobs, interval {interval:g} s, {intervals} intervals (load {load:.1f}):"
              f"  operator CPU {per_job * 1e3:.2f} ms per job per interval ({used / (interval * intervals):.1%} of a core)"
              f"   shown progress age p50 {statistics.median(age) / interval:.2f} / p99 {percentile(age, 99) / interval:.2f}"
              f" intervals ({percentile(age, 99):.1f} s)   failed reads {failures}", flush=True)
    finally:
        stand_in.terminate()
        stand_in.wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="running jobs (stand-in trainers)")
    parser.add_argument("--interval", type=float, default=10.0, help="the progress interval (the chart's default: 10 s)")
    parser.add_argument("--intervals", type=int, default=6, help="intervals measured")
    parser.add_argument("--way", choices=("poll", "push"), action="append", help="default: both")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the stand-in process
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve, args.started, args.way[0], args.interval))
        return
    for way in args.way or ("poll", "push"):
        measure(way, args.jobs, args.interval, args.intervals)
    if "poll" in (args.way or ("poll",)):
        print(f"poll  + finding each rank-0 pod (kube.trainer_pods, the LIST's answer decoded): "
              f"{pod_lookup_cpu() * 1e3:.2f} ms per job per interval more", flush=True)


if __name__ == "__main__":
    sys.exit(main())
