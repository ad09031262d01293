"""`hearth run --profile DIR` and `[profile]`: the scheduled steps recorded
by libtorch's profiler, one Chrome trace per process with hearth's own
steps in it as spans, the busiest operators printed, and the refusals."""
import collections
import json

from conftest import SHORT_JOB, mpirun, write_config

# What hearth marks in every recorded step of a training run.
STEP_SPANS = ["hearth::next_batch", "hearth::forward", "hearth::backward", "hearth::optimizer_step"]


def spans(trace_path):
    """Counts of the trace's user_annotation events by name, and the trace."""
    trace = json.loads(trace_path.read_text())
    names = collections.Counter(e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation")
    return names, trace


def inside(trace, outer, inner):
    """How many `inner` events lie within an `outer` event."""
    events = trace["traceEvents"]
    (o,) = [e for e in events if e["name"] == outer]
    return sum(1 for e in events if e["name"] == inner and o["ts"] <= e["ts"] <= o["ts"] + o["dur"])


def test_profile_flag_records_the_scheduled_steps_with_hearths_spans(hearth, tmp_path):
    config = write_config(tmp_path, SHORT_JOB)
    run = hearth("run", config, "--quiet", "--steps", 12, "--profile", tmp_path / "traces")
    assert run.returncode == 0, run.stderr
    trace_path = tmp_path / "traces" / "profile_0.json"
    names, trace = spans(trace_path)
    # The default schedule: wait 5, warm up 1, record 3, once.
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
        "ProfilerStep#6",
        "ProfilerStep#7",
        "ProfilerStep#8",
    ]
    for step in (6, 7, 8):
        for span in STEP_SPANS:
            assert inside(trace, f"ProfilerStep#{step}", span) == 1, (step, span)
    ops = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::linear", "aten::addmm", "aten::_fused_adamw_"} <= ops, sorted(ops)
    assert "Input Dims" not in json.dumps(trace)  # record-shapes is off by default
    assert f"profile of optimizer steps 7 to 9 (ProfilerStep#6 to #8) written to {trace_path}" in run.stdout
    assert "aten::" in run.stdout.split("written to", 1)[1]
    summary = json.loads((tmp_path / "runs" / "short" / "summary.json").read_text())
    assert summary["profile"] == str(trace_path)


def test_profile_table_sets_the_schedule_options_and_folder(hearth, tmp_path):
    config = write_config(
        tmp_path,
        SHORT_JOB + "\n[profile]\nwait = 0\nwarmup = 1\nactive = 2\nrecord-shapes = true\n",
    )
    run = hearth("run", config, "--quiet", "--steps", 6)
    assert run.returncode == 0, run.stderr
    names, trace = spans(tmp_path / "runs" / "short" / "profile" / "profile_0.json")
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert trace["record_shapes"] == 1
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"] if e["name"] == "aten::addmm")


def test_two_processes_write_a_trace_each_with_their_rank_and_the_gradient_sync(hearth_bin, tmp_path):
    config = write_config(tmp_path, SHORT_JOB)
    run = mpirun(hearth_bin, 2, "run", config, "--quiet", "--steps", 10, "--profile", tmp_path / "traces", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        names, trace = spans(tmp_path / "traces" / f"profile_{rank}.json")
        info = json.loads(trace["distributedInfo"]) if isinstance(trace["distributedInfo"], str) else trace["distributedInfo"]
        assert info == {"backend": "mpi", "rank": rank, "world_size": 2}
        assert names["hearth::gradient_sync"] == 3, names
        assert names["hearth::bucket_reduce_start"] >= 3, names


def test_bad_profile_settings_are_refused_naming_the_key(hearth, tmp_path):
    late = write_config(tmp_path, SHORT_JOB + "\n[profile]\nwait = 50\n", "late.toml")
    run = hearth("run", late)
    assert run.returncode == 2
    assert "late.toml" in run.stderr and "profile" in run.stderr and "only 40 steps" in run.stderr, run.stderr

    cuda = write_config(tmp_path, SHORT_JOB + '\n[profile]\nactivities = ["cuda"]\n', "cuda.toml")
    run = hearth("run", cuda, "--cpu")
    assert run.returncode == 2
    assert '"cuda" was asked for, but this machine has no CUDA device' in run.stderr, run.stderr

    bad = write_config(tmp_path, SHORT_JOB + '\n[profile]\nactivities = ["tpu"]\n', "tpu.toml")
    run = hearth("run", bad)
    assert run.returncode == 2
    assert "profile.activities" in run.stderr and '"tpu"' in run.stderr, run.stderr
