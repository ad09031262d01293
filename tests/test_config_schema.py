"""`hearth config schema` is a JSON Schema that the example configs pass and
that catches what hearth refuses (an unknown key, a value outside an
enum), read by the jsonschema package (an oracle no one here wrote); and
the book's config reference is exactly what the code generates."""

import json
import subprocess
import sys
import tomllib

import jsonschema
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "tools"))
import config_reference  # noqa: E402

HEARTH = ROOT / "target" / "debug" / "hearth"
# The training configs of examples/ (plugin manifests, Python and Node
# projects and the JS tracker's dependencies are not).
EXAMPLES = sorted(
    p
    for p in (ROOT / "examples").rglob("*.toml")
    if p.name not in ("plugin.toml", "pyproject.toml", "Cargo.toml") and "node_modules" not in p.parts
)


@pytest.fixture(scope="module")
def validator():
    out = subprocess.run([str(HEARTH), "config", "schema"], capture_output=True, text=True, check=True)
    schema = json.loads(out.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_examples_are_configs():
    names = {p.relative_to(ROOT).as_posix() for p in EXAMPLES}
    assert {"examples/sort-digits.toml", "examples/bench-gpt.toml", "examples/finetune-hf/finetune.toml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_example_config_passes_the_schema_and_hearth(validator, path):
    config = tomllib.loads(path.read_text())
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(config)]
    assert not errors, errors


def test_the_schema_refuses_what_hearth_refuses(validator, tmp_path):
    base = tomllib.loads((ROOT / "examples" / "sort-digits.toml").read_text())
    cases = {
        "unknown key": ("run", "stepz", 3),
        "unknown section": (None, "runn", {"steps": 3}),
        "value outside the enum": ("model", "kind", "transformer"),
        "wrong type": ("run", "steps", "many"),
        "unknown fsdp field": ("fsdp", "state-dict-config", "x"),
    }
    # The command takes the unchanged config, so an exit of 2 below is the
    # config's doing.
    good = tmp_path / "good.toml"
    good.write_text(to_toml(base))
    ok = subprocess.run([str(HEARTH), "model", "plan", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for name, (section, key, value) in cases.items():
        config = json.loads(json.dumps(base))
        if section is None:
            config[key] = value
        else:
            config.setdefault(section, {})[key] = value
        assert list(validator.iter_errors(config)), f"the schema let through a config with an {name}"
        # hearth refuses it too: the schema says what hearth says.
        path = tmp_path / f"{name.replace(' ', '-')}.toml"
        path.write_text(to_toml(config))
        run = subprocess.run([str(HEARTH), "model", "plan", str(path)], capture_output=True, text=True)
        assert run.returncode == 2, f"hearth took a config with an {name}: {run.stdout}{run.stderr}"
        assert str(path) in run.stderr or path.name in run.stderr, run.stderr


def to_toml(config: dict) -> str:
    """A config of tables of scalars, arrays and inline tables as TOML."""

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(v)

    lines = []
    for section, table in config.items():
        if isinstance(table, list):
            for entry in table:
                lines.append(f"[[{section}]]")
                lines += [f"{json.dumps(k)} = {value(v)}" for k, v in entry.items()]
        else:
            lines.append(f"[{section}]")
            lines += [f"{json.dumps(k)} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def test_the_config_reference_page_is_what_the_code_generates():
    committed = config_reference.PAGE.read_text()
    generated = config_reference.render(config_reference.schema())
    assert committed == generated, (
        "docs/src/config-reference.md differs from the config types: run "
        "`python3 tests/tools/config_reference.py --write`"
    )


def test_the_config_reference_lists_every_key_of_every_section():
    """The page's own drift check above compares the page with the renderer;
    this one reads the schema apart from the renderer's logic, so a renderer
    that skips a section (as it once skipped every optional one) fails."""
    schema = config_reference.schema()
    page = config_reference.PAGE.read_text()
    missing = []
    for name in schema["properties"]:
        heading, body = config_reference.section_body(name, schema)
        start = page.find(f"## `{heading}`")
        assert start >= 0, f"the config reference has no {heading} section"
        end = page.find("\n## ", start + 1)
        text = page[start:] if end < 0 else page[start:end]
        missing += [f"{heading} {key}" for key in body.get("properties", {}) if f"| `{key}` |" not in text]
    sections_with_keys = [n for n in schema["properties"] if config_reference.section_body(n, schema)[1].get("properties")]
    assert {"fsdp", "scheduler", "profile"} <= set(sections_with_keys), sections_with_keys
    assert not missing, f"keys of the schema the page lacks: {missing}"
