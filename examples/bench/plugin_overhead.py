"""What plugins cost the training loop, end to end, in one run: the peer's
tiny GPT (examples/bench-gpt.toml) logging every step, without plugins and
with a scheduler plugin (`linear`, called every step) plus three tracker
plugins (jsonl, tensorboard, mlflow, fed every step), alternately, ROUNDS
times each. Prints tokens/s of both, their ratio and the overhead per step,
and what the plugged runs' own accounts say the plugins took (`plugin_calls`
of summary.json: the scheduler's wall time on the training loop and the
trackers' CPU time on their thread, instantiations included) as a share of
the run's steps: end to end, a few per cent of noise between runs of the
same binary hides a cost of a fraction of one. Then the network rows: the
`http-json` tracker fed every step, posting to a live local server and to a
port where nothing listens, and the `mlflow` tracker with `tracking-uri`
on a live `mlflow server` (the mlflow package's, SQLite) and on a dead
port, and the `wandb` tracker offline and online to a dead port, each
against no tracker in the same rounds (n, median and min-max
of the per-round ratios). Then runs the per-call
micro-benchmark (host/bench/src/bin/plugin_calls.rs).
A benchmark, not a test: nothing is asserted.
Usage: make bench-plugins  (or: python plugin_overhead.py [ROUNDS])
"""
import http.server
import json
import os
import socket
import threading
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEARTH = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
STEPS = 60
BASE = (ROOT / "examples" / "bench-gpt.toml").read_text().replace("log-every = 60", "log-every = 1")
PLUGINS = """
[scheduler]
name = "linear"
warmup-steps = 10

[[trackers]]
name = "jsonl"

[[trackers]]
name = "tensorboard"

[[trackers]]
name = "mlflow"
"""
TOKENS_PER_STEP = 16 * 128


def summary(folder: pathlib.Path, config_text: str) -> dict:
    """The summary.json of one run of CONFIG_TEXT in FOLDER."""
    folder.mkdir(parents=True)
    (folder / "job.toml").write_text(config_text)
    subprocess.run([HEARTH, "run", "job.toml", "--cpu", "--quiet", "--steps", str(STEPS)], cwd=folder, check=True,
                   capture_output=True)
    return json.loads((folder / "runs" / "bench-gpt" / "summary.json").read_text())


def accounted(run: dict) -> float:
    """The share of a run's STEPS that its plugin calls took, by its own
    account: a scheduler's wall time (the training loop waits for it), a
    tracker's CPU time (its thread runs beside training), and every
    instantiation's wall time."""
    step = TOKENS_PER_STEP / run["tokens_per_sec"]
    taken = sum((u["wall_seconds"] if u["kind"] == "scheduler" else u["cpu_seconds"]) + u["instantiate_seconds"]
                for u in run["plugin_calls"])
    return taken / (STEPS * step)


def measure(rounds: int) -> tuple[list, list, list]:
    """tokens/s without plugins and with them, ROUNDS alternating runs each,
    and the plugged runs' accounted share."""
    bare, plugged, shares = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            # Every other round the plugged run goes first: a machine that
            # slows within a round then weighs on both sides alike.
            first_plugged = i % 2 == 1
            if not first_plugged:
                bare.append(summary(pathlib.Path(tmp) / f"bare{i}", BASE)["tokens_per_sec"])
            run = summary(pathlib.Path(tmp) / f"plugged{i}", BASE + PLUGINS)
            plugged.append(run["tokens_per_sec"])
            shares.append(accounted(run))
            if first_plugged:
                bare.append(summary(pathlib.Path(tmp) / f"bare{i}", BASE)["tokens_per_sec"])
            print(f"round {i + 1}: no plugins {bare[-1]:.0f} tokens/s, scheduler + 3 trackers {plugged[-1]:.0f} "
                  f"tokens/s, by their account {shares[-1] * 100:.2f} % of the steps")
    return bare, plugged, shares


def network_tracker(port: int) -> str:
    return (f'\n[[trackers]]\nname = "http-json"\nurl = "http://127.0.0.1:{port}/log"\n'
            f'\n[plugin-permissions.http-json]\nnetwork = ["http://127.0.0.1:{port}"]\n')


def mlflow_tracker(port: int) -> str:
    return (f'\n[[trackers]]\nname = "mlflow"\ntracking-uri = "http://127.0.0.1:{port}"\n'
            f'\n[plugin-permissions.mlflow]\nnetwork = ["http://127.0.0.1:{port}"]\n')


def wandb_tracker(port) -> str:
    """The wandb tracker: offline (port None), or online to `port`."""
    if port is None:
        return '\n[[trackers]]\nname = "wandb"\n'
    return (f'\n[[trackers]]\nname = "wandb"\nmode = "online"\nbase-url = "http://127.0.0.1:{port}"\nflush-seconds = 1\n'
            f'\n[plugin-permissions.wandb]\nnetwork = ["http://127.0.0.1:{port}"]\nenv = ["WANDB_API_KEY"]\n')


def start_mlflow_server(folder: pathlib.Path):
    """The mlflow package's own tracking server (SQLite) on a free port,
    once it answers /health: (process, port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root", str(folder / "art")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server, port
        except OSError:
            time.sleep(0.5)
    os.killpg(server.pid, signal.SIGTERM)
    sys.exit("mlflow server did not start")


class Sink(http.server.BaseHTTPRequestHandler):
    """A live server: reads each POST and answers 200."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


NETWORK_SIDES = ["http-json, live server", "http-json, dead port", "mlflow, live server", "mlflow, dead port",
                 "wandb, offline", "wandb, dead port"]


def measure_network(rounds: int) -> dict:
    """Tokens/s per round with `http-json` (a live local server, a dead
    port) and `mlflow` (a live `mlflow server`, a dead port), and without
    a tracker, each round's runs in another order."""
    live = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    server_dir = pathlib.Path(tempfile.mkdtemp())
    os.environ.setdefault("WANDB_API_KEY", "bench" + "k" * 35)  # online mode wants one; the port is dead
    mlflow, mlflow_port = start_mlflow_server(server_dir)
    sides = dict(zip(["none"] + NETWORK_SIDES, [
        BASE, BASE + network_tracker(live.server_address[1]), BASE + network_tracker(dead_port),
        BASE + mlflow_tracker(mlflow_port), BASE + mlflow_tracker(dead_port),
        BASE + wandb_tracker(None), BASE + wandb_tracker(dead_port)]))
    rates = {name: [] for name in sides}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            names = list(sides)
            # One run first, not counted: the first run of a batch ran at half
            # speed (14.7 k tokens/s against 29-31 k after), cold caches.
            summary(pathlib.Path(tmp) / "warm-up", BASE)
            for i in range(rounds):
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    folder = pathlib.Path(tmp) / f"{name.replace(' ', '-').replace(',', '')}{i}"
                    rates[name].append(summary(folder, sides[name])["tokens_per_sec"])
                print(f"network round {i + 1} ({' then '.join(order)}): "
                      + ", ".join(f"{n} {rates[n][-1]:.0f}" for n in names) + " tokens/s")
    finally:
        live.shutdown()
        os.killpg(mlflow.pid, signal.SIGTERM)
        mlflow.wait(timeout=30)
        shutil.rmtree(server_dir, ignore_errors=True)
    return rates


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    bare, plugged, shares = measure(rounds)
    b, p = statistics.median(bare), statistics.median(plugged)
    overhead_us = (TOKENS_PER_STEP / p - TOKENS_PER_STEP / b) * 1e6
    print(f"tiny GPT, logging every step, median of {rounds}:")
    print(f"  no plugins                      {b:9.0f} tokens/s ({TOKENS_PER_STEP / b * 1e3:.1f} ms/step)")
    print(f"  linear + jsonl/tensorboard/mlflow {p:7.0f} tokens/s")
    print(f"  ratio with/without = {p / b:.3f}; overhead {overhead_us:+.0f} µs/step (noise included)")
    print(f"  the plugins' own account: {statistics.median(shares) * 100:.2f} % of the steps")
    rates = measure_network(rounds)
    print(f"network trackers fed every step, n={rounds}:")
    print(f"  no tracker             {statistics.median(rates['none']):9.0f} tokens/s")
    for side in NETWORK_SIDES:
        ratios = [a / b for a, b in zip(rates[side], rates["none"])]
        print(f"  {side:22s} {statistics.median(rates[side]):9.0f} tokens/s, ratio {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    print("per call:")
    subprocess.run(["cargo", "run", "--quiet", "-p", "hearth-bench", "--bin", "plugin_calls"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
