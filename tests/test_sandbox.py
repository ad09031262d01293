"""Hostile and malformed plugins (fixtures in tests/plugins, built here):
each is contained with a message naming it, the run completes (and its
training loop never waits for them), a well-behaved
tracker beside them still sees every step, and nothing outside a tracker's
own folder is touched."""
import hashlib
import os
import pathlib
import shutil
import socket
import subprocess
import tomllib

import pytest

from conftest import LOGGED_STEPS, ROOT, SHORT_JOB, make_plugin, run_hearth, tracker_tables, write_config, WIT_VERSION

HOSTILE = {
    # A long deadline: the trap test counts its faults, and on a loaded
    # machine the tracker thread (nice 19) can miss the default 5 s.
    "trap": "[limits]\ncall-timeout-ms = 30000\n",
    "spin": "[limits]\ncall-timeout-ms = 300\n",
    "sleep": "[limits]\ncall-timeout-ms = 300\n",
    "hog": "[limits]\nmemory-mb = 32\n",
    "snoop": "",
    "socket": "",
    "shout": "",
}
PORT = 47613  # the socket fixture tries to reach this port


def tree(folder: pathlib.Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def hostile_run(hearth_bin, fixture_wasm, tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile")
    plugins = work / "third-party"
    for name, limits in HOSTILE.items():
        make_plugin(plugins, name, fixture_wasm(name), limits=limits)
    config = write_config(work, SHORT_JOB + tracker_tables(*HOSTILE, "jsonl"))
    (work / "secret.txt").write_text("not for plugins")

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen()
    listener.setblocking(False)
    before = tree(work)
    passwd = os.stat("/etc/passwd").st_mtime_ns
    try:
        out = run_hearth(hearth_bin, "run", "--plugin-dir", plugins, config, cwd=work, timeout=300)
        try:
            listener.accept()
            connected = True
        except BlockingIOError:
            connected = False
    finally:
        listener.close()
    after = tree(work)
    assert os.stat("/etc/passwd").st_mtime_ns == passwd
    return {"out": out, "run": work / "runs" / "short", "work": work, "before": before, "after": after,
            "connected": connected}


def warnings(out, name):
    return [l for l in out.stderr.splitlines() if f"tracker plugin `{name}`" in l]


def test_the_run_completes_and_a_good_tracker_sees_every_step(hostile_run):
    out = hostile_run["out"]
    assert out.returncode == 0, out.stderr
    assert "eval exact-match accuracy" in out.stdout
    assert (hostile_run["run"] / "model.safetensors").exists()
    lines = (hostile_run["run"] / "trackers" / "jsonl" / "metrics.jsonl").read_text().splitlines()
    assert sorted({int(l.split('"step":')[1].split(",")[0].rstrip("}")) for l in lines}) == LOGGED_STEPS


def test_nothing_outside_the_trackers_folders_is_touched(hostile_run):
    work, run = hostile_run["work"], hostile_run["run"]
    created = set(hostile_run["after"]) - set(hostile_run["before"])
    outside = [p for p in created if run not in p.parents and p != run and p.parent != work]
    assert outside == []
    assert not list(work.rglob("escape.txt"))
    assert not (run.parent / "escape.txt").exists() and not pathlib.Path("/escape.txt").exists()
    for p, mtime in hostile_run["before"].items():
        assert hostile_run["after"][p] == mtime, f"{p} was modified"
    # What the run wrote outside trackers/ is hearth's own.
    assert {p.name for p in run.iterdir()} == {"config.toml", "summary.json", "model.safetensors", "metrics.jsonl", "trackers"}


def test_a_trap_drops_the_instance_and_a_fresh_one_goes_on(hostile_run):
    out = hostile_run["out"]
    (line,) = warnings(out, "trap")
    assert "failed in log at step 10: trapped: wasm trap: wasm `unreachable` instruction executed" in line
    assert "training goes on" in line
    assert "fixture trap at step 10" in out.stderr  # its panic message, via its stderr
    seen = (hostile_run["run"] / "trackers" / "trap" / "seen.txt").read_text().split("\n")
    # start, the trap at step 10, then start on a fresh instance.
    assert seen[:3] == ["start", "trapped", "start"]
    # Step 10 comes again (the fault contract), then 20-40 and the eval
    # values logged at step 40.
    assert [l for l in seen if l.startswith("log")] == ["log 10", "log 20", "log 30", "log 40", "log 40"]


def test_an_endless_loop_hits_the_deadline_and_is_disabled(hostile_run):
    lines = warnings(hostile_run["out"], "spin")
    assert sum("exceeded its call deadline of 300 ms" in l for l in lines) == 3
    assert "disabled after 3 faults" in lines[-1]


def test_a_call_blocked_in_the_host_is_abandoned_at_the_deadline(hostile_run):
    lines = warnings(hostile_run["out"], "sleep")
    assert sum("exceeded its call deadline of 300 ms (blocked in a host call)" in l for l in lines) == 3, lines
    assert "disabled after 3 faults" in lines[-1]


def test_unbounded_allocation_hits_the_memory_cap(hostile_run):
    lines = warnings(hostile_run["out"], "hog")
    assert sum("hit its memory cap of 32 MiB" in l for l in lines) == 3, lines
    assert "disabled after 3 faults" in lines[-1]


def test_files_outside_its_folder_are_out_of_reach(hostile_run):
    line, links = warnings(hostile_run["out"], "snoop")
    assert "failed in start: returned an error: denied: read /etc/passwd" in line
    # The relative link it made to ../../config.toml is gone after the run.
    assert "left 1 symbolic link(s)" in links and "leak -> ../../config.toml" in links
    folder = hostile_run["run"] / "trackers" / "snoop"
    assert not any(p.is_symlink() for p in folder.rglob("*"))
    attempts = (hostile_run["run"] / "trackers" / "snoop" / "attempts.txt").read_text().splitlines()
    assert len(attempts) == 8
    assert all(a.startswith("denied: ") for a in attempts), attempts


def test_the_network_is_out_of_reach(hostile_run):
    assert not hostile_run["connected"]
    (line,) = warnings(hostile_run["out"], "socket")
    assert "returned an error: denied: tcp 127.0.0.1:47613" in line
    attempts = (hostile_run["run"] / "trackers" / "socket" / "attempts.txt").read_text().splitlines()
    assert len(attempts) == 3 and all(a.startswith("denied: ") for a in attempts), attempts


def test_a_100_mb_line_is_cut_not_kept(hostile_run):
    out = hostile_run["out"]
    assert len(out.stderr) < 1_000_000
    (line,) = [l for l in out.stderr.splitlines() if "[plugin shout stdout]" in l]
    assert f"({100 * 2**20 - 4096} more bytes cut)" in line
    steps = (hostile_run["run"] / "trackers" / "shout" / "steps.txt").read_text().split()
    assert list(map(int, steps)) == LOGGED_STEPS + [40]  # + the eval values
    assert warnings(out, "shout") == []


CORE_MODULE = b"\0asm\x01\0\0\0"


@pytest.mark.parametrize(
    "fixture, reason",
    [
        ("core-module", "it is a core WebAssembly module, not a component"),
        ("wrong-world", 'plugin.toml says kind = "tracker"'),
        ("other-major", f"it was built for hearth:plugin@1.0.0, and this host speaks hearth:plugin@{WIT_VERSION}"),
    ],
)
def test_malformed_plugins_are_refused_at_load(hearth, fixture_wasm, tmp_path, fixture, reason):
    plugins = tmp_path / "third-party"
    if fixture == "core-module":
        (tmp_path / "core.wasm").write_bytes(CORE_MODULE)
        folder = make_plugin(plugins, fixture, tmp_path / "core.wasm")
    else:
        folder = make_plugin(plugins, fixture, fixture_wasm(fixture))

    check = hearth("plugins", "check", folder)
    assert check.returncode != 0
    assert f"plugin `{fixture}`" in check.stderr and reason in check.stderr, check.stderr

    config = write_config(tmp_path, SHORT_JOB + tracker_tables(fixture))
    run = hearth("run", "--plugin-dir", plugins, config)
    assert run.returncode == 2
    assert f"plugin `{fixture}`" in run.stderr and reason in run.stderr, run.stderr
    assert not (tmp_path / "runs" / "short" / "model.safetensors").exists()


def test_a_manifest_declaring_another_world_version_is_refused(hearth, tmp_path):
    """A component built for this WIT version whose plugin.toml says 1.0.0: the version
    is compared with the component's own, at check and at load."""
    plugins = tmp_path / "third-party"
    built = ROOT / "target" / "plugins" / "jsonl" / "jsonl.wasm"
    folder = make_plugin(plugins, "claims-one", built)
    manifest = folder / "plugin.toml"
    manifest.write_text(manifest.read_text().replace(f"tracker-plugin@{WIT_VERSION}", "tracker-plugin@1.0.0"))
    reason = ("declares world hearth:plugin/tracker-plugin@1.0.0, but the component was built for "
              f"hearth:plugin@{WIT_VERSION}")

    check = hearth("plugins", "check", folder)
    assert check.returncode == 2 and "plugin `claims-one`" in check.stderr and reason in check.stderr, check.stderr
    config = write_config(tmp_path, SHORT_JOB + tracker_tables("claims-one"))
    run = hearth("run", "--plugin-dir", plugins, config)
    assert run.returncode == 2 and reason in run.stderr, run.stderr


def test_a_broken_manifest_stops_only_the_runs_that_use_it(hearth, tmp_path):
    plugins = tmp_path / "third-party"
    (plugins / "half-written").mkdir(parents=True)
    manifest = plugins / "half-written" / "plugin.toml"
    manifest.write_text('name = "half"\nkind = "tracker"\n')

    listed = hearth("plugins", "list", "--plugin-dir", plugins)
    assert listed.returncode == 0, listed.stderr
    assert f"not loadable: `half` ({manifest})" in listed.stdout and "jsonl" in listed.stdout, listed.stdout

    unused = hearth("run", "--plugin-dir", plugins, write_config(tmp_path, SHORT_JOB + tracker_tables("jsonl")))
    assert unused.returncode == 0, unused.stderr
    assert f"skipping plugin folder {manifest.parent}" in unused.stderr, unused.stderr
    assert (tmp_path / "runs" / "short" / "trackers" / "jsonl" / "metrics.jsonl").exists()

    used = hearth("run", "--plugin-dir", plugins, write_config(tmp_path, SHORT_JOB + tracker_tables("half"), "uses.toml"))
    assert used.returncode == 2
    assert f"invalid plugin manifest {manifest}" in used.stderr and "missing field" in used.stderr, used.stderr


def test_an_unknown_tracker_is_named(hearth, tmp_path):
    config = write_config(tmp_path, SHORT_JOB + tracker_tables("tensorbored"))
    run = hearth("run", config)
    assert run.returncode == 2
    assert "tensorbored" in run.stderr and str(config.name) in run.stderr, run.stderr


def test_plugins_list_and_inspect_show_the_built_ins(hearth):
    listing = hearth("plugins", "list")
    assert listing.returncode == 0, listing.stderr
    # A table: the cells of each row, between its rules.
    rows = {}
    for line in listing.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│").split("┆")]
        if len(cells) == 6:
            rows[cells[0]] = cells
    for name in ["jsonl", "csv", "tensorboard", "mlflow", "dvclive", "wandb"]:
        _, _, kind, world, found, sha256 = rows[name]
        assert kind == "tracker" and world == f"hearth:plugin/tracker-plugin@{WIT_VERSION}" and "built-in" in found
        # The embedded component is the one `make plugins` built.
        assert sha256 == hashlib.sha256((ROOT / "target" / "plugins" / name / f"{name}.wasm").read_bytes()).hexdigest()
    assert rows["linear"][2:4] == ["scheduler", f"hearth:plugin/scheduler-plugin@{WIT_VERSION}"]
    # Long names keep the columns aligned.
    widths = {len(l) for l in listing.stdout.splitlines() if l.startswith("│")}
    assert len(widths) == 1 and "constant-with-warmup" in rows
    inspect = hearth("plugins", "inspect", "tensorboard")
    assert inspect.returncode == 0, inspect.stderr
    assert "its logging folder, read-write, at /logs" in inspect.stdout
    assert "network: none" in inspect.stdout and "loads:       yes" in inspect.stdout


def test_a_swapped_plugin_is_refused_by_its_pin_naming_both_hashes(hearth, tmp_path):
    """`hearth plugins lock` pins what a config uses in hearth.lock (the
    hash `sha256sum` gives); the pinned component runs; the same file
    replaced by another component of the same world is refused before it
    is compiled, naming both hashes, and nothing trains."""
    plugins = tmp_path / "third-party"
    shutil.copytree(ROOT / "target" / "plugins" / "jsonl", plugins / "jsonl")
    component = plugins / "jsonl" / "jsonl.wasm"
    pinned = hashlib.sha256(component.read_bytes()).hexdigest()
    config = write_config(tmp_path, SHORT_JOB + '\n[[trackers]]\nname = "jsonl"\n')
    locked = hearth("plugins", "lock", config, "--plugin-dir", plugins)
    assert locked.returncode == 0, locked.stderr
    assert tomllib.loads((tmp_path / "hearth.lock").read_text()) == {"plugins": {"jsonl": pinned}}
    out = hearth("run", "--plugin-dir", plugins, config)
    assert out.returncode == 0, out.stderr

    shutil.copy(ROOT / "target" / "plugins" / "csv" / "csv.wasm", component)
    swapped = hashlib.sha256(component.read_bytes()).hexdigest()
    shutil.rmtree(tmp_path / "runs")
    out = hearth("run", "--plugin-dir", plugins, config)
    assert out.returncode != 0
    assert "jsonl" in out.stderr and pinned in out.stderr and swapped in out.stderr, out.stderr
    assert not (tmp_path / "runs" / "short" / "model.safetensors").exists()
    listing = hearth("plugins", "list", "--plugin-dir", plugins)
    assert swapped in listing.stdout

    # A table's own pin works the same way, and must agree with the lock.
    table_pinned = write_config(tmp_path, SHORT_JOB + f'\n[[trackers]]\nname = "jsonl"\nsha256 = "{swapped}"\n')
    out = hearth("run", "--plugin-dir", plugins, table_pinned)
    assert out.returncode != 0 and f"pins `jsonl` to {swapped}, but" in out.stderr and pinned in out.stderr, out.stderr
    (tmp_path / "hearth.lock").unlink()
    out = hearth("run", "--plugin-dir", plugins, table_pinned)
    assert out.returncode == 0, out.stderr



def test_a_swapped_wrap_policy_is_refused_by_the_fsdp_sections_pin(hearth, tmp_path):
    """`[fsdp] auto-wrap-policy-sha256` pins the wrap-policy plugin as a
    tracker's `sha256` does: the right hash trains, another component in
    its place is refused before it is compiled, naming both hashes."""
    plugins = tmp_path / "third-party"
    shutil.copytree(ROOT / "target" / "plugins" / "transformer-based", plugins / "transformer-based")
    component = plugins / "transformer-based" / "wrap-policies.wasm"
    pinned = hashlib.sha256(component.read_bytes()).hexdigest()
    fsdp = ('\n[fsdp]\nsharding-strategy = "FULL_SHARD"\nauto-wrap-policy = "transformer-based"\n'
            f'transformer-cls-names-to-wrap = ["Block"]\nauto-wrap-policy-sha256 = "{pinned}"\n')
    config = write_config(tmp_path, SHORT_JOB + fsdp)
    out = hearth("run", "--plugin-dir", plugins, config)
    assert out.returncode == 0, out.stderr
    shutil.copy(ROOT / "target" / "plugins" / "csv" / "csv.wasm", component)
    swapped = hashlib.sha256(component.read_bytes()).hexdigest()
    shutil.rmtree(tmp_path / "runs")
    out = hearth("run", "--plugin-dir", plugins, config)
    assert out.returncode != 0
    assert "transformer-based" in out.stderr and pinned in out.stderr and swapped in out.stderr, out.stderr
    assert not (tmp_path / "runs" / "short" / "model.safetensors").exists()
    # A pin without a policy to pin is refused, not ignored.
    bare = write_config(tmp_path, SHORT_JOB + f'\n[fsdp]\nauto-wrap-policy-sha256 = "{pinned}"\n', "bare.toml")
    out = hearth("run", "--plugin-dir", plugins, bare)
    assert out.returncode != 0 and "fsdp.auto-wrap-policy-sha256" in out.stderr and "pins nothing" in out.stderr, out.stderr


def plugin_lines(out, name):
    return [l for l in out.stderr.splitlines() if f"[plugin {name} stdout]" in l]


def test_a_plugin_cannot_fill_the_disk_past_its_quota(hearth, fixture_wasm, tmp_path):
    """Issue 18, item 2: a tracker's folder holds at most `disk-mb` and
    `files` (here lowered by its manifest to 2 MiB and 40 entries); a write
    past them fails inside the plugin with an error it handles (no space
    left on device: raw os error 51 under WASI), not a trap, and the run
    goes on. A run config raises them for a plugin it trusts."""
    plugins = tmp_path / "third-party"
    make_plugin(plugins, "filler", fixture_wasm("filler"), limits="[limits]\ndisk-mb = 2\nfiles = 40\n")
    config = write_config(tmp_path, SHORT_JOB + tracker_tables("filler"))
    out = hearth("run", "--plugin-dir", plugins, config, timeout=300)
    assert out.returncode == 0, out.stderr
    (line,) = plugin_lines(out, "filler")
    assert "bytes=2097152 " in line, line
    assert "append_error=" in line and "/51" in line.split("append_error=")[1].split()[0], line
    assert "files=39 " in line and "file_error=" in line and line.endswith("/51"), line
    folder = tmp_path / "runs" / "short" / "trackers" / "filler"
    assert (folder / "big.bin").stat().st_size == 2 << 20
    assert len(list(folder.rglob("*"))) <= 40
    assert "trapped" not in out.stderr and "disabled" not in out.stderr, out.stderr

    raised = SHORT_JOB + tracker_tables("filler") + "\n[plugin-limits.filler]\ndisk-mb = 3\n"
    config = write_config(tmp_path, raised.replace('name = "short"', 'name = "raised"'), "raised.toml")
    out = hearth("run", "--plugin-dir", plugins, config, timeout=300)
    assert out.returncode == 0, out.stderr
    (line,) = plugin_lines(out, "filler")
    assert "bytes=3145728 " in line, line


def test_a_manifest_cannot_raise_its_own_quota(hearth, fixture_wasm, tmp_path):
    plugins = tmp_path / "third-party"
    make_plugin(plugins, "filler", fixture_wasm("filler"), limits="[limits]\ndisk-mb = 4096\n")
    out = hearth("run", "--plugin-dir", plugins, write_config(tmp_path, SHORT_JOB + tracker_tables("filler")))
    assert out.returncode == 2
    assert "limits.disk-mb" in out.stderr and "[plugin-limits.filler]" in out.stderr, out.stderr
    # A run config's limits for a plugin the run does not use: a typo, named.
    text = SHORT_JOB + tracker_tables("jsonl") + "\n[plugin-limits.jsnol]\ndisk-mb = 10\n"
    out = hearth("run", write_config(tmp_path, text, "typo.toml"))
    assert out.returncode == 2 and "plugin-limits.jsnol" in out.stderr and "jsonl" in out.stderr, out.stderr


def test_a_plugins_output_has_a_budget_per_call_and_per_run(hearth, fixture_wasm, tmp_path):
    """Issue 18, item 2: 5 000 lines per call reach the log as at most
    1 000 per call, and 2 500 over the run (its manifest's lowered budget);
    the rest is dropped with a line saying how much."""
    plugins = tmp_path / "third-party"
    make_plugin(plugins, "chatter", fixture_wasm("chatter"), limits="[limits]\nlog-lines-per-run = 2500\n")
    config = write_config(tmp_path, SHORT_JOB + tracker_tables("chatter"))
    out = hearth("run", "--plugin-dir", plugins, config)
    assert out.returncode == 0, out.stderr
    kept = plugin_lines(out, "chatter")
    assert len(kept) == 2500, len(kept)
    assert sum("chatter start line" in l for l in kept) == 1000
    dropped = [l for l in out.stderr.splitlines() if "[plugin chatter] dropped" in l]
    assert dropped and "dropped 4000 line(s)" in dropped[0], dropped
    calls = 2 + len(LOGGED_STEPS) + 1  # start, each log, the eval values, finish
    assert len(out.stderr) < 2_000_000
    assert len(dropped) <= calls
