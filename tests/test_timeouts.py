"""No test can hang: a command a test starts (conftest's `start`) that does
not finish within its limit is killed, all its processes, and the test
fails naming itself, the command, and the last lines of each rank's
output."""
import time

import pytest

from conftest import mpi_env, mpirun_command, start, tagged


def test_a_job_that_never_ends_fails_its_test_in_time_and_leaves_nothing_behind(tmp_path):
    # Rank 1 says it started, then sleeps in a session of its own, out of
    # reach of mpirun's process group: only its tag finds it.
    script = ('echo "rank $OMPI_COMM_WORLD_RANK started" >&2; '
              '[ "$OMPI_COMM_WORLD_RANK" = 0 ] || { touch ready; setsid -w sleep 600; }')
    env = mpi_env()
    command = mpirun_command(2, "sh", "-c", script)
    with pytest.raises(pytest.fail.Exception) as failed:
        with start(command, cwd=tmp_path, env=env, timeout=3) as job:
            # However slow mpirun is to start the ranks.
            deadline = time.monotonic() + 120
            while not (tmp_path / "ready").exists():
                assert time.monotonic() < deadline, "rank 1 never started"
                time.sleep(0.02)
            started = time.monotonic()
            job.finish()
    assert time.monotonic() - started < 30, "killed soon after its limit"
    message = str(failed.value)
    first = message.splitlines()[0]
    name = "test_timeouts.py::test_a_job_that_never_ends_fails_its_test_in_time_and_leaves_nothing_behind"
    assert f"{name}: `mpirun " in first, message
    assert first.endswith("did not finish within 3s; its processes were killed"), message
    assert "--- rank 1, stderr ---\nrank 1 started\n" in message, message
    assert tagged(job.tag) == [], "left behind"
