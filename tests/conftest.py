"""Shared helpers for the end-to-end tests: they run the `hearth` binary the
way a user does (built by `make test`) and read its output with Python
readers. Every command a test starts runs under a time limit (`start`), so
that no test can hang."""
import contextlib
import itertools
import os
import pathlib
import re
import shlex
import signal
import subprocess
import threading
import time
import tomllib

import pytest
import tomli_w

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The WIT package version hearth speaks, from its one source.
WIT_VERSION = re.search(r"package hearth:plugin@([^;]+);", (ROOT / "wit" / "plugin.wit").read_text()).group(1)

# The variable that marks every process a test starts, and theirs: what finds
# those that left the command's session (torchrun's workers, `script`'s
# shell) when they must be killed.
TAG = "HEARTH_TEST_TAG"
_TAGS = itertools.count()
# How many lines of each rank's output a failure message shows.
TAIL = 20
# mpirun's `--tag-output` tag, put before each piece a process wrote:
# `[1,3]<stderr>:` (Open MPI 4; `[job@1,3]` in 5).
MPIRUN_TAG = re.compile(r"\[([^\[\] ]+),(\d+)\]<std(?:out|err)>:")
LAUNCH_TAG = re.compile(r"\[rank (\d+)\] ")


class Job:
    """A command a test started (`start`): in a session of its own, stdin
    empty, stdout and stderr read as it runs, and every process it starts
    marked with a tag of its own in the environment. As a context manager,
    it is killed with all its processes if it still runs at the end of the
    block (the test failed mid-way)."""

    def __init__(self, cmd, cwd, env, timeout):
        self.cmd = [str(c) for c in cmd]
        self.timeout = timeout
        self.tag = f"{os.getpid()}-{next(_TAGS)}"
        environ = dict(os.environ if env is None else env)
        environ[TAG] = self.tag
        self.proc = subprocess.Popen(
            self.cmd, cwd=cwd, env=environ, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        self.deadline = time.monotonic() + timeout
        self._out = [bytearray(), bytearray()]
        self._readers = [
            threading.Thread(target=self._read, args=(pipe, out), daemon=True)
            for pipe, out in zip((self.proc.stdout, self.proc.stderr), self._out)
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe, out):
        with pipe:
            for chunk in iter(lambda: pipe.read1(8192), b""):
                out += chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.kill()

    def _ended(self, until) -> bool:
        """Whether the command exits and closes its output before `until`."""
        try:
            self.proc.wait(timeout=max(0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        for reader in self._readers:
            reader.join(timeout=max(0, until - time.monotonic()))
        return not any(reader.is_alive() for reader in self._readers)

    def finish(self) -> subprocess.CompletedProcess:
        """What subprocess.run(capture_output=True, text=True) gives, once
        the command has ended and closed its output, within its time limit
        from its start. Past it, its processes are killed (SIGTERM to its
        session's group, SIGKILL 5 s later, and to every process with its
        tag) and the test fails, naming itself, the command, and the last
        lines of each rank's output."""
        if not self._ended(self.deadline):
            self.kill()
            test = os.environ.get("PYTEST_CURRENT_TEST", "a test").rsplit(" (", 1)[0]
            pytest.fail(
                f"{test}: `{shlex.join(self.cmd)}` did not finish within {self.timeout}s; "
                f"its processes were killed\n{tails(*self._text())}",
                pytrace=False,
            )
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, *self._text())

    def kill(self):
        """Kills its processes and waits for the command (and, up to 5 s,
        for its output to close)."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        self._ended(time.monotonic() + 5)
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(20):
            left = tagged(self.tag)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        self.proc.wait()
        self._ended(time.monotonic() + 5)

    def _text(self):
        return [bytes(out).decode(errors="replace") for out in self._out]


def limit() -> int:
    """How long a command a test starts may run: `$HEARTH_TEST_TIMEOUT_S`
    seconds, 600 when unset."""
    return int(os.environ.get("HEARTH_TEST_TIMEOUT_S", 600))


def start(cmd, *, cwd=None, env=None, timeout=None) -> Job:
    """Starts `cmd` (in `cwd`, with `env` or this environment) as a `Job`
    that must finish within `timeout` seconds of its start (`limit()` when
    not given)."""
    return Job(cmd, cwd, env, limit() if timeout is None else timeout)


def run_command(cmd, *, cwd=None, env=None, timeout=None) -> subprocess.CompletedProcess:
    """`start`'s job, finished: what subprocess.run(capture_output=True,
    text=True) gives, or the test failed past its time limit."""
    with start(cmd, cwd=cwd, env=env, timeout=timeout) as job:
        return job.finish()


def tagged(tag) -> list:
    """The pids of the processes, other than this one, whose environment
    holds `tag` (see `Job.tag`)."""
    entry = f"{TAG}={tag}".encode()
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if entry in environ.split(b"\0"):
            pids.append(int(proc.name))
    return pids


def lines(text: str) -> list:
    """(rank or None, line) for each line of one stream of a command's
    output: the rank where a tag names it, hearth launch's `[rank 3] ` or
    mpirun's `--tag-output`, whose tag comes before every piece a process
    wrote, so that a line written in several writes (Rust's unbuffered
    stderr writes each formatted part) comes in pieces, put together here
    as hearth launch does: a process's line ends with the piece that ends
    mpirun's."""
    found, partial = [], {}
    if not text:
        return found
    for line in text.removesuffix("\n").split("\n"):
        tags = list(MPIRUN_TAG.finditer(line))
        if not tags:
            launched = LAUNCH_TAG.match(line)
            found.append((int(launched[1]), line[launched.end():]) if launched else (None, line))
            continue
        if tags[0].start() > 0:
            found.append((None, line[: tags[0].start()]))
        for k, tag in enumerate(tags):
            rank = int(tag[2])
            end = tags[k + 1].start() if k + 1 < len(tags) else len(line)
            partial[rank] = partial.get(rank, "") + line[tag.end():end]
            if k + 1 == len(tags):
                found.append((rank, partial.pop(rank)))
    return found + list(partial.items())


def ranked(text: str) -> str:
    """The output of an `mpirun --tag-output` command with each line whole
    and a rank's as `[rank r] <line>`, as hearth launch shows them."""
    return "".join(f"{line}\n" if rank is None else f"[rank {rank}] {line}\n" for rank, line in lines(text))


def tails(stdout: str, stderr: str) -> str:
    """The last 20 lines of each rank's stdout and stderr, and of those no
    rank is named on (`lines`), under a heading each."""
    streams = {}
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        for rank, line in lines(text):
            streams.setdefault((-1 if rank is None else rank, name), []).append(line)
    shown = []
    for (rank, name), said in sorted(streams.items(), key=lambda s: (s[0][0], s[0][1] == "stderr")):
        who = "" if rank < 0 else f"rank {rank}, "
        of = f" (last {TAIL} of {len(said)} lines)" if len(said) > TAIL else ""
        shown += [f"--- {who}{name}{of} ---", *said[-TAIL:]]
    return "\n".join(shown) + "\n" if shown else "(no output)\n"


@pytest.fixture(scope="session")
def hearth_bin() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("HEARTH_BIN", ROOT / "target" / "debug" / "hearth"))
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make test` (it builds the binary first)")
    return path


def run_hearth(binary, *args, cwd, timeout=None, env=None):
    """Runs hearth with the given arguments in `cwd`, without
    LD_LIBRARY_PATH (the binary must find libtorch through its rpath)."""
    environ = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    environ.setdefault("HEARTH_LOG", "info")
    environ.update(env or {})
    return run_command([binary, *args], cwd=cwd, env=environ, timeout=timeout)


@pytest.fixture
def hearth(hearth_bin, tmp_path):
    """Runs hearth with the given arguments in `tmp_path`."""

    def run(*args, cwd=None, timeout=None, env=None):
        return run_hearth(hearth_bin, *args, cwd=cwd or tmp_path, timeout=timeout, env=env)

    return run


def mpi_env(**extra) -> dict:
    """The environment of an mpirun (or `hearth launch`) job here: this
    one's, without LD_LIBRARY_PATH (hearth finds libtorch by its rpath),
    and with Open MPI allowed to run as root, as the tests do; `extra`
    variables on top."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    return env


def mpirun_command(n, *program) -> list:
    """`mpirun` starting `program` on `n` processes here, more processes
    than cores allowed, each line tagged with its rank (`ranked` reads
    them)."""
    return ["mpirun", "--oversubscribe", "--tag-output", "-n", str(n), *map(str, program)]


def mpirun(hearth_bin, n, *args, cwd, machines=1, timeout=None):
    """`hearth` on `n` processes, spread over `machines` pretend machines
    (each process told its machine's name by HEARTH_NODE_NAME), within
    `timeout` seconds (`limit()` when not given); a rank's lines come as
    `[rank r] …` (`ranked`)."""
    env = mpi_env()
    command = ["mpirun", "--oversubscribe", "--tag-output"]
    for m in range(machines):
        if m:
            command.append(":")
        command += ["-n", str(n // machines), "-x", f"HEARTH_NODE_NAME=machine-{m}", str(hearth_bin), *map(str, args)]
    run = run_command(command, cwd=cwd, env=env, timeout=timeout)
    return subprocess.CompletedProcess(run.args, run.returncode, ranked(run.stdout), ranked(run.stderr))


def processes_of_rank(rank: int, config=None) -> list:
    """The pids of running `hearth` processes that mpirun started as world
    rank `rank` — running `config`, when given (so that a test never
    signals another test's, or a soak's, processes)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if not cmdline[0].endswith(b"hearth") or f"OMPI_COMM_WORLD_RANK={rank}".encode() not in environ:
            continue
        if config is None or str(config).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def write_config(folder: pathlib.Path, text: str, name: str = "job.toml") -> pathlib.Path:
    path = folder / name
    path.write_text(text)
    return path


TINY_JOB = ROOT / "tests" / "fixtures" / "tiny-job.toml"


def tiny_job(**tables) -> str:
    """The canonical tiny job (tests/fixtures/tiny-job.toml, which Rust's
    hearth_testkit::TinyJob reads too) as TOML text, each table given
    updated with its dict (`run={"steps": 24}`; a key set to None is
    removed; a table the file lacks is added, a list of dicts as an array
    of tables)."""
    job = tomllib.loads(TINY_JOB.read_text())
    for name, keys in tables.items():
        if isinstance(keys, list):
            job[name] = keys
            continue
        table = job.setdefault(name, {})
        for key, value in keys.items():
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
    return tomli_w.dumps(job)


# A short GPT job for the plugin tests: logs at steps 10, 20, 30 and 40.
SHORT_JOB = tiny_job(run={"name": "short", "project": "trackers-test"})
LOGGED_STEPS = [10, 20, 30, 40]


def tracker_tables(*names: str) -> str:
    return "".join(f'\n[[trackers]]\nname = "{n}"\n' for n in names)


FIXTURE_BUILD = ROOT / "target" / "test-plugins-build" / "wasm32-wasip2" / "release"


@pytest.fixture(scope="session")
def fixture_wasm():
    """Builds the hostile/malformed plugin fixtures in tests/plugins (cargo
    is incremental: quick when nothing changed) and returns a function that
    maps a fixture crate name to its .wasm."""
    # A build from nothing takes longer than a test's usual limit.
    built = run_command(["cargo", "build", "--release", "--quiet"], cwd=ROOT / "tests" / "plugins", timeout=max(limit(), 900))
    assert built.returncode == 0, built.stderr
    return lambda name: FIXTURE_BUILD / f"fixture_{name.replace('-', '_')}.wasm"


def make_plugin(parent: pathlib.Path, name: str, wasm: pathlib.Path, kind="tracker", limits="") -> pathlib.Path:
    """A plugin folder `parent/name` holding `wasm` and its plugin.toml."""
    folder = parent / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.wasm").write_bytes(wasm.read_bytes())
    (folder / "plugin.toml").write_text(
        f'name = "{name}"\nversion = "0.1.0"\nkind = "{kind}"\n'
        f'world = "hearth:plugin/{kind}-plugin@{WIT_VERSION}"\ncomponent = "{name}.wasm"\n{limits}'
    )
    return folder


@pytest.fixture(scope="session")
def traced(tmp_path_factory):
    """`traced(family)`: a tiny transformers model of `family` (hf_causal:
    llama, qwen2, mistral, gpt2) saved with `save_pretrained` and traced,
    built once per test session: {"pretrained": folder, "traced": .pt}."""
    import hf_causal

    built = {}

    def get(family: str) -> dict:
        if family not in built:
            built[family] = hf_causal.build(family, tmp_path_factory.mktemp(f"traced-{family}"))
        return built[family]

    return get
