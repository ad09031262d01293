"""`hearth report` and the run history from the outside: the page is valid
HTML (Python's parser), names no address, has one chart per metric logged;
the PNGs are PNGs of the chart size; two runs give two labelled curves and
their config differences; headless Chromium renders the charts; `--watch`
follows a run until it finishes; a resumed run's history has each step once;
and the progress line says what matters."""
import html.parser
import json
import os
import pathlib
import shutil
import time

import numpy
import pytest
from PIL import Image

from conftest import ROOT, mpi_env, run_command, run_hearth, start, tiny_job, write_config

CHART_SIZE = (960, 440)
RUN_COLOUR = (31, 119, 180)  # the first run's colour (Tableau blue)
SECOND_COLOUR = (255, 127, 14)


def job(name: str, lr: float = 2e-3, steps: int = 40, extra: str = "") -> str:
    """The tiny job as `name`, evaluated and saved every 20 steps; `extra`:
    lines for its [run] table."""
    text = tiny_job(
        run={"name": name, "steps": steps, "seed": 1, "save-every": 20},
        optimizer={"lr": lr, "max-grad-norm": 1.0},
        eval={"samples": 40, "every": 20},
    )
    return text.replace("[run]\n", "[run]\n" + extra, 1)


class Page(html.parser.HTMLParser):
    """Collects the charts, the tags that could fetch something, and text."""

    def __init__(self):
        super().__init__()
        self.figures, self.addresses, self.tags, self.svg_texts, self.strokes = [], [], [], [], set()
        self.in_svg_text = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "figure":
            self.figures.append(attrs.get("data-metric"))
        for key in ("src", "href", "data", "action", "poster"):
            if key in attrs:
                self.addresses.append(attrs[key])
        if tag == "text":
            self.in_svg_text = True
        if tag in ("polyline", "path") and attrs.get("stroke", "").startswith("#"):
            self.strokes.add(attrs["stroke"].lower())

    def handle_endtag(self, tag):
        if tag == "text":
            self.in_svg_text = False

    def handle_data(self, data):
        if self.in_svg_text:
            self.svg_texts.append(data.strip())


def parse(path: pathlib.Path) -> Page:
    page = Page()
    page.feed(path.read_text())
    page.close()
    return page


def logged_metrics(run_dir: pathlib.Path) -> set:
    names = set()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "event" not in record:
            names |= {k for k in record if k not in ("step", "time")}
    return names


@pytest.fixture(scope="module")
def two_runs(hearth_bin, tmp_path_factory):
    """Two short runs that differ in their learning rate."""
    root = tmp_path_factory.mktemp("report")
    for name, lr in (("lr-small", 5e-4), ("lr-large", 3e-3)):
        config = write_config(root, job(name, lr), f"{name}.toml")
        out = run_hearth(hearth_bin, "run", config, cwd=root)
        assert out.returncode == 0, out.stderr
    return root / "runs" / "lr-small", root / "runs" / "lr-large"


def test_the_report_is_valid_self_contained_html_with_a_chart_per_metric(hearth, two_runs, tmp_path):
    run = two_runs[0]
    out = hearth("report", run, "-o", tmp_path / "out")
    assert out.returncode == 0, out.stderr
    html_path = tmp_path / "out" / "report.html"
    page = parse(html_path)
    assert page.tags[0] == "html" and "body" in page.tags
    metrics = logged_metrics(run)
    assert {"loss", "lr", "tokens_per_sec", "grad_norm", "eval/accuracy"} <= metrics
    assert sorted(page.figures) == sorted(metrics), "one chart per metric logged"
    # Nothing is fetched: no address in any attribute, no URL anywhere.
    assert page.addresses == []
    text = html_path.read_text()
    assert "http" not in text and "url(" not in text and "<script" not in text
    for metric in metrics:
        png = tmp_path / "out" / (metric.replace("/", "_") + ".png")
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size == CHART_SIZE, png
            # Not a blank image: the curve's colour is drawn.
            assert image.convert("RGB").getcolors(10**6) and len(image.convert("RGB").getcolors(10**6)) > 20
    # The checkpoints are marked on the charts.
    assert "checkpoint" in page.svg_texts
    # The run's summary is in the page.
    assert "exact-match accuracy" in text and "finished" in text


def test_two_runs_give_two_labelled_curves_and_their_config_differences(hearth, two_runs, tmp_path):
    out = hearth("report", *two_runs, "-o", tmp_path / "both")
    assert out.returncode == 0, out.stderr
    page = parse(tmp_path / "both" / "report.html")
    # Each chart's legend names both runs, each in its own colour.
    assert page.svg_texts.count("lr-small") >= 4 and page.svg_texts.count("lr-large") >= 4, page.svg_texts
    assert any(t.startswith("lr-small (smoothed") for t in page.svg_texts)
    assert {"#%02x%02x%02x" % RUN_COLOUR, "#%02x%02x%02x" % SECOND_COLOUR} <= page.strokes
    text = (tmp_path / "both" / "report.html").read_text()
    differences = text[text.index('class="differences"'):]
    differences = differences[: differences.index("</table>")]
    assert "optimizer.lr" in differences and "0.0005" in differences and "0.003" in differences
    assert "model.d-model" not in differences, "only the keys that differ"
    with Image.open(tmp_path / "both" / "loss.png") as image:
        colours = {c for _, c in image.convert("RGB").getcolors(10**6)}
    assert RUN_COLOUR in colours and SECOND_COLOUR in colours


def test_chromium_renders_the_charts(hearth, two_runs, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is installed by `make setup`"
    out = hearth("report", *two_runs, "-o", tmp_path / "r")
    assert out.returncode == 0, out.stderr
    shot = tmp_path / "shot.png"
    drawn = run_command(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=1100,2600",
         f"--screenshot={shot}", (tmp_path / "r" / "report.html").as_uri()],
        timeout=120,
    )
    assert drawn.returncode == 0, drawn.stderr
    with Image.open(shot) as image:
        rgb = image.convert("RGB")
    width, height = rgb.size
    # Below the tables, the charts: bands with the runs' curves in them.
    drawn = 0
    for top in range(400, height - 100, 220):
        band = rgb.crop((0, top, width, top + 220))
        colours = dict((c, n) for n, c in band.getcolors(width * 220))
        variance = numpy.asarray(band, dtype=float).mean(axis=2).var()
        if variance > 50 and colours.get(RUN_COLOUR, 0) + colours.get(SECOND_COLOUR, 0) > 100:
            drawn += 1
    assert drawn >= 5, f"only {drawn} bands of the screenshot hold curves"


def test_watch_follows_a_run_until_it_finishes(hearth_bin, tmp_path):
    run = tmp_path / "runs" / "live"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(job("live"))
    with open(run / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 10, "time": 1.0, "loss": 2.0}) + "\n")
    out = tmp_path / "watched"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    # Two waits of up to 60 s for the page, then the end of the watch.
    with start([hearth_bin, "report", run, "-o", out, "--watch", "--interval", "1"], env=env, timeout=180) as watch:
        def wait_for(check, what):
            deadline = time.time() + 60
            while time.time() < deadline:
                page = out / "report.html"
                if page.exists() and check(page.read_text()):
                    return page.read_text()
                assert watch.proc.poll() is None or what == "finished", watch.finish()
                time.sleep(0.2)
            pytest.fail(f"the report never showed {what}")

        first = wait_for(lambda t: 'data-metric="loss"' in t, "the loss")
        assert 'http-equiv="refresh"' in first and "running" in first
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 20, "time": 2.0, "loss": 1.5, "eval/accuracy": 0.25}) + "\n")
        wait_for(lambda t: 'data-metric="eval/accuracy"' in t, "the new metric")
        (run / "summary.json").write_text(json.dumps({"final_loss": 1.5, "device": "cpu"}))
        ended = watch.finish()
        assert ended.returncode == 0, ended.stderr
        final = (out / "report.html").read_text()
        assert 'http-equiv="refresh"' not in final and "finished" in final


def test_a_resumed_run_keeps_each_step_once(hearth, tmp_path):
    config = write_config(tmp_path, job("resumed", steps=40))
    assert hearth("run", config).returncode == 0
    history = tmp_path / "runs" / "resumed" / "metrics.jsonl"
    # A crash after the last checkpoint (step 40) left a line the resumed
    # run will log again.
    with open(history, "a") as f:
        f.write(json.dumps({"step": 50, "time": 0.0, "loss": 99.0}) + "\n")
    out = hearth("run", config, "--resume", "--steps", "60")
    assert out.returncode == 0, out.stderr
    losses = [json.loads(l) for l in history.read_text().splitlines()]
    steps = [r["step"] for r in losses if "loss" in r]
    assert steps == [10, 20, 30, 40, 50, 60], steps
    assert all(r.get("loss") != 99.0 for r in losses)
    checkpoints = [r["step"] for r in losses if r.get("event") == "checkpoint"]
    assert checkpoints == [20, 40, 60]


def test_a_folder_that_is_no_run_is_named(hearth, tmp_path):
    out = hearth("report", tmp_path)
    assert out.returncode == 2
    assert str(tmp_path) in out.stderr and "metrics.jsonl" in out.stderr
    out = hearth("report", tmp_path / "missing")
    assert out.returncode == 2 and "no such folder" in out.stderr
    (tmp_path / "a-file").write_text("x")
    out = hearth("report", tmp_path / "a-file")
    assert out.returncode == 2 and "is a file" in out.stderr
    # A history with lines that are not records (a crash, an editor) still
    # draws what it has.
    run = tmp_path / "runs" / "garbled"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 2.0}\nnot json\n{"step": 20, "loss": 1.0}\n{"step": 30, "lo')
    out = hearth("report", run)
    assert out.returncode == 0, out.stderr
    assert 'data-metric="loss"' in (run / "report" / "report.html").read_text()


def test_the_progress_bar_shows_step_loss_throughput_and_eta(hearth_bin, tmp_path):
    config = write_config(tmp_path, job("bar", steps=40))
    # `script` gives hearth a terminal, as a user's shell does.
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["COLUMNS"] = "160"
    out = run_command(["script", "-qec", f"{hearth_bin} run {config}", "/dev/null"], cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stdout
    screen = out.stdout
    for word in ["/40", "ETA", "loss", "tok/s"]:
        assert word in screen, screen[-2000:]


def test_two_processes_name_the_slowest_rank(hearth, tmp_path):
    config = write_config(tmp_path, job("two", steps=20))
    out = hearth("launch", "-n", "2", config, env=mpi_env(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [l for l in (out.stdout + out.stderr).splitlines() if "step 10/20" in l]
    assert lines and all("slowest rank" in l and "ms/step" in l for l in lines), lines
