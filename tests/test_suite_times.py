"""`make test`'s closing table (tests/tools/timed.sh and suite_times.py):
each part's time and exit status as the wrapper recorded them, each Rust
test binary's time from cargo's lines, and pytest's files from the JUnit
XML pytest itself writes (the oracle: a real pytest run of two files)."""
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "tools"))
import suite_times  # noqa: E402

TIMED = ROOT / "tests" / "tools" / "timed.sh"
# What `cargo test` prints around one unit-test binary and one integration
# test (cargo 1.9x).
CARGO_LOG = """\
     Running unittests src/lib.rs (target/debug/deps/hearth_comm-0e2a1f6c9b8d7e55)

running 2 tests
test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 4.50s

     Running tests/distributed/main.rs (target/debug/deps/distributed-5d1c2b3a4f6e7d88)

test result: ok. 46 passed; 0 failed; 0 ignored; 0 measured; 15 filtered out; finished in 77.33s

   Doc-tests hearth_comm

test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
"""


def test_the_wrapper_records_each_part_and_passes_its_exit_status_on(tmp_path):
    env = {**os.environ, "TIMES": str(tmp_path)}
    ok = subprocess.run([TIMED, "first part", "bash", "-c", "echo said; sleep 0.2"], env=env, capture_output=True, text=True)
    failed = subprocess.run([TIMED, "second", "bash", "-c", "exit 3"], env=env, capture_output=True, text=True)
    assert (ok.returncode, failed.returncode) == (0, 3)
    assert ok.stdout == "said\n" and (tmp_path / "first part.log").read_text() == "said\n"
    rows = suite_times.parts(tmp_path)
    assert [(name, status) for name, _, status in rows] == [("first part", "0"), ("second", "3")]
    assert 0.2 <= rows[0][1] < 30, rows


def test_the_table_names_each_test_binary_and_the_slowest_pytest_files(tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_slow.py").write_text("import time\n\ndef test_a():\n    time.sleep(0.3)\n\ndef test_b():\n    time.sleep(0.2)\n")
    (tests / "test_quick.py").write_text("def test_c():\n    pass\n")
    xml = tmp_path / "pytest.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={xml}"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    files = dict(suite_times.pytest_files(xml))
    assert set(files) == {"test_slow.py", "test_quick.py"}, files
    assert files["test_slow.py"] >= 0.5 > files["test_quick.py"], files

    (tmp_path / "Rust tests.log").write_text(CARGO_LOG)
    (tmp_path / "parts.tsv").write_text("Rust tests\t90.0\t0\npytest\t12.5\t1\n")
    table = suite_times.table(tmp_path)
    lines = [" ".join(line.split()) for line in table.splitlines()]
    assert "Rust tests 1:30.0" in lines, table
    assert "hearth_comm: src/lib.rs 0:04.5" in lines, table
    assert "distributed: tests/distributed/main.rs 1:17.3" in lines, table
    # A binary under a second is left out.
    assert "doc-tests" not in table, table
    assert "pytest 0:12.5 (exit 1)" in lines, table
    assert lines.index("test_slow.py " + suite_times.minutes(files["test_slow.py"])) < \
        lines.index("test_quick.py " + suite_times.minutes(files["test_quick.py"])), table
    assert "total 1:42.5" in lines, table
