"""The `wandb` tracker against a W&B server, with wandb's own client as the
oracle of what a server gets. The server here is a small stand-in that
answers the calls wandb's client makes (GraphQL `upsertBucket` and
`createRunFiles`, `file_stream`, file uploads) and keeps what it was sent.
Validated by the real client first: `wandb sync` uploads an offline run
that wandb itself wrote (fed the same values through Accelerate's
WandBTracker). Then hearth's online mode, and hearth's offline run uploaded
by `wandb sync`, must hand it the same config, history rows and summary.
Nothing here is checked against W&B's hosted service."""
import base64
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import LOGGED_STEPS, SHORT_JOB, tracker_tables, write_config

API_KEY = "hearthtestkey" + "k" * 27  # 40 characters, as W&B's keys


class WandbServer:
    """What a W&B server is sent, per run id: `config` (from upsertBucket),
    `history` (file_stream lines, at the offsets they were sent), `summary`,
    `complete`, `exitcode`, and the `auth` headers."""

    def __init__(self):
        self.runs = {}
        self.auth = set()
        # file_stream requests still to answer with 503.
        self.fail_streams = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                server.auth.add(self.headers.get("authorization"))
                if self.path.endswith("/file_stream") and server.fail_streams > 0:
                    server.fail_streams -= 1
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                answer = server.answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_PUT = do_POST

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def run(self, run_id):
        return self.runs.setdefault(run_id, {"config": None, "history": {}, "summary": None, "complete": None, "exitcode": None})

    def answer(self, path, body):
        if path != "/graphql" and not path.endswith("/file_stream"):
            return {}  # file uploads, the client's own telemetry
        doc = json.loads(body)
        if path == "/graphql":
            query, variables = doc["query"], doc.get("variables") or {}
            if "upsertBucket" in query:
                run = self.run(variables["name"])
                if variables.get("config"):
                    run["config"] = json.loads(variables["config"])
                project = {"id": "p", "name": variables.get("project") or "uncategorized",
                           "entity": {"id": "e", "name": variables.get("entity") or "default-entity"}}
                return {"data": {"upsertBucket": {"bucket": {
                    "id": "b", "name": variables["name"], "displayName": variables.get("displayName"),
                    "description": "", "config": variables.get("config"), "sweepName": None,
                    "historyLineCount": 0, "project": project}, "inserted": True}}}
            if "createRunFiles" in query:
                files = [{"name": f, "uploadUrl": f"{self.url}/upload/{f}"} for f in variables["files"]]
                return {"data": {"createRunFiles": {"runID": "b", "uploadHeaders": [], "files": files}}}
            return {"data": {}}
        if path.endswith("/file_stream"):
            run = self.run(path.split("/")[-2])
            for name, part in doc.get("files", {}).items():
                if name == "wandb-history.jsonl":
                    for i, line in enumerate(part["content"]):
                        run["history"][part["offset"] + i] = json.loads(line)
                elif name == "wandb-summary.json":
                    run["summary"] = json.loads(part["content"][-1])
            if "complete" in doc:
                run["complete"], run["exitcode"] = doc["complete"], doc.get("exitcode")
            return {"exitcode": None, "limits": {}}
        return {}

    def close(self):
        self.http.shutdown()


@pytest.fixture
def wandb_server():
    server = WandbServer()
    yield server
    server.close()


def without_clock(row):
    return {k: v for k, v in row.items() if k not in ("_runtime", "_timestamp", "_wandb")}


def config_values(config):
    """upsertBucket's config ({key: {"value": v}}) as {key: v}, wandb's own keys left out."""
    return {k: v["value"] for k, v in config.items() if not k.startswith("_")}


def wandb_sync(folder, server, cwd):
    env = {"WANDB_BASE_URL": server.url, "WANDB_API_KEY": API_KEY, "WANDB_SILENT": "true",
           "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    wandb = Path(sys.executable).parent / "wandb"
    out = subprocess.run([wandb, "sync", "--yes", str(folder)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def logged_by_jsonl(run_dir):
    steps, values = {}, 0
    for line in (run_dir / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        steps.setdefault(entry.pop("step"), {}).update(entry)
        values += len(entry)
    return steps, values


def reference(server, run_dir, folder, monkeypatch):
    """What `wandb sync` sends the server for an offline run that wandb
    itself wrote, through Accelerate's WandBTracker, with the values the
    hearth run in `run_dir` logged (its jsonl tracker): run id `reference`."""
    from accelerate import PartialState
    from accelerate.tracking import WandBTracker

    logged, _ = logged_by_jsonl(run_dir)
    config = json.loads((run_dir / "trackers" / "jsonl" / "config.json").read_text())["config"]
    folder.mkdir()
    with monkeypatch.context() as m:
        m.setenv("WANDB_MODE", "offline")
        m.setenv("WANDB_SILENT", "true")
        m.chdir(folder)
        PartialState()
        tracker = WandBTracker("trackers-test", name="short", id="reference", dir=str(folder))
        tracker.start()
        tracker.store_init_configuration(config)
        for step in sorted(logged):
            tracker.log(logged[step], step=step)
        tracker.finish()
    wandb_sync(folder / "wandb", server, folder)
    ref = server.runs.pop("reference")
    # The stand-in got what a server gets: every logged step, the config, the end.
    assert [ref["history"][i]["_step"] for i in sorted(ref["history"])] == LOGGED_STEPS
    assert ref["complete"] is True and ref["exitcode"] == 0
    return ref


def assert_same_run(ours, ref):
    assert sorted(ours["history"]) == list(range(len(LOGGED_STEPS))), "history lines at offsets 0, 1, ..."
    assert [without_clock(ours["history"][i]) for i in sorted(ours["history"])] == \
           [without_clock(ref["history"][i]) for i in sorted(ref["history"])]
    assert config_values(ours["config"]) == config_values(ref["config"])
    assert without_clock(ours["summary"]) == without_clock(ref["summary"])
    assert (ours["complete"], ours["exitcode"]) == (True, 0)


def wandb_job(server, **options):
    text = SHORT_JOB + tracker_tables("jsonl") + '\n[[trackers]]\nname = "wandb"\n'
    text += "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    if options.get("mode") == "online":
        text += f'\n[plugin-permissions.wandb]\nnetwork = ["{server.url}"]\nenv = ["WANDB_API_KEY"]\n'
    return text


def test_online_mode_sends_what_wandbs_own_client_sends_for_the_same_values(hearth, tmp_path, wandb_server, monkeypatch):
    run = tmp_path / "online"
    run.mkdir()
    text = wandb_job(wandb_server, mode="online", id="online", **{"base-url": wandb_server.url, "send-every-seconds": 0})
    out = hearth("run", write_config(run, text), cwd=run, env={"WANDB_API_KEY": API_KEY})
    assert out.returncode == 0, out.stderr
    assert "failed" not in out.stderr, out.stderr
    # The key went as wandb's client sends it, on every request, and nowhere else.
    assert wandb_server.auth == {"Basic " + base64.b64encode(f"api:{API_KEY}".encode()).decode()}
    ref = reference(wandb_server, run / "runs" / "short", tmp_path / "wandb-itself", monkeypatch)
    assert_same_run(wandb_server.runs["online"], ref)
    assert API_KEY not in out.stdout + out.stderr
    for path in (run / "runs").rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path
    # Every value delivered, none waiting.
    _, values = logged_by_jsonl(run / "runs" / "short")
    summary = json.loads((run / "runs" / "short" / "summary.json").read_text())
    (health,) = [t for t in summary["trackers"] if t["name"] == "wandb"]
    assert health["delivery"] == {"sent": values, "retried": 0, "spooled": 0, "dropped": 0}, health


def test_wandb_sync_uploads_the_offline_run_as_it_uploads_wandbs_own(hearth, tmp_path, wandb_server, monkeypatch):
    run = tmp_path / "offline"
    run.mkdir()
    out = hearth("run", write_config(run, wandb_job(wandb_server, id="offline")), cwd=run)
    assert out.returncode == 0, out.stderr
    wandb_sync(run / "runs" / "short" / "trackers" / "wandb", wandb_server, run)
    ref = reference(wandb_server, run / "runs" / "short", tmp_path / "wandb-itself", monkeypatch)
    assert_same_run(wandb_server.runs["offline"], ref)


def test_a_server_that_fails_at_first_gets_every_row_once_at_its_offset(hearth, tmp_path, wandb_server):
    wandb_server.fail_streams = 3
    text = wandb_job(wandb_server, mode="online", id="flaky", **{"base-url": wandb_server.url, "send-every-seconds": 0})
    out = hearth("run", write_config(tmp_path, text), env={"WANDB_API_KEY": API_KEY})
    assert out.returncode == 0, out.stderr
    got = wandb_server.runs["flaky"]
    assert wandb_server.fail_streams == 0
    assert sorted(got["history"]) == list(range(len(LOGGED_STEPS)))
    assert [got["history"][i]["_step"] for i in range(len(LOGGED_STEPS))] == LOGGED_STEPS
    assert (got["complete"], got["exitcode"]) == (True, 0)
    _, values = logged_by_jsonl(tmp_path / "runs" / "short")
    summary = json.loads((tmp_path / "runs" / "short" / "summary.json").read_text())
    (health,) = [t for t in summary["trackers"] if t["name"] == "wandb"]
    assert health["delivery"]["sent"] == values and health["delivery"]["dropped"] == 0, health
    assert health["delivery"]["retried"] > 0, health
