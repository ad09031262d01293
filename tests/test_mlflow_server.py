"""The `mlflow` tracker against a real MLflow tracking server: the
`mlflow` package's own `mlflow server` (SQLite behind it), started here on
a free port, granted to the plugin, and read back with MlflowClient —
every metric at every step, the params, the tags, the FINISHED status.
The same job logs to the jsonl tracker, the oracle of the values."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import LOGGED_STEPS, SHORT_JOB, write_config


def free_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The URL of a running `mlflow server`."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(folder / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail("mlflow server did not start:\n" + (folder / "server.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def test_mlflow_logs_every_step_to_a_real_tracking_server_and_finishes_the_run(hearth, tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    text = (SHORT_JOB + '\n[[trackers]]\nname = "jsonl"\n'
            f'\n[[trackers]]\nname = "mlflow"\ntracking-uri = "{mlflow_server}"\n'
            f'\n[plugin-permissions.mlflow]\nnetwork = ["{mlflow_server}"]\n')
    out = hearth("run", write_config(tmp_path, text))
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "runs" / "short"
    logged, values = {}, 0
    for line in (run_dir / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        logged.setdefault(entry.pop("step"), {}).update(entry)
        values += len(entry)

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("trackers-test")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "short"
    numeric = {name for values in logged.values() for name, v in values.items() if not isinstance(v, str)}
    for name in numeric:
        history = client.get_metric_history(run.info.run_id, name)
        steps = [s for s in LOGGED_STEPS if name in logged.get(s, {})]
        assert [m.step for m in history] == steps, name
        assert [m.value for m in history] == pytest.approx([float(logged[s][name]) for s in steps]), name
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == LOGGED_STEPS
    assert run.data.params["optimizer.lr"] == "0.002"
    assert run.data.params["model.kind"] == "gpt"
    assert run.data.tags["eval/summary"] == logged[40]["eval/summary"]
    # Every value delivered, none waiting.
    summary = json.loads((run_dir / "summary.json").read_text())
    (health,) = [t for t in summary["trackers"] if t["name"] == "mlflow"]
    assert health["delivery"] == {"sent": values, "retried": 0, "spooled": 0, "dropped": 0}, health
    assert health["faults"] == []
    assert not (run_dir / "trackers" / "mlflow" / "outbox" / "spool.jsonl").exists()


def test_a_tracking_uri_that_is_not_http_is_refused_by_name_and_the_run_goes_on(hearth, tmp_path):
    text = SHORT_JOB + '\n[[trackers]]\nname = "mlflow"\ntracking-uri = "ftp://127.0.0.1:21"\n'
    out = hearth("run", write_config(tmp_path, text))
    assert out.returncode == 0, out.stderr
    assert "eval exact-match accuracy" in out.stdout
    said = [l for l in out.stderr.splitlines() if "`mlflow` failed in start" in l]
    assert said and 'tracking-uri "ftp://127.0.0.1:21": an http(s):// URL' in said[0], out.stderr
