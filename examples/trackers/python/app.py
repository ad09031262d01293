"""A hearth tracker in Python: one JSON line per logged step in
/logs/steps.jsonl and, with the option `url`, each step POSTed as JSON to
that URL over wasi:http (a host the run config grants in
[plugin-permissions.python-tracker] network). Built into a WebAssembly
component by componentize-py against hearth's WIT and WASI's HTTP
interfaces (world.wit; see docs/src/plugins.md)."""
import json

from componentize_py_types import Err, Ok
from wit_world import exports
from wit_world.imports import outgoing_handler
from wit_world.imports import log as host
from wit_world.imports import wasi_http_types as http


def post_json(url: str, doc) -> int:
    """POSTs `doc` as JSON to `url` and returns the answer's status. hearth
    checks the request before it connects: a host not granted comes back
    as an error (raised here), and nothing is sent."""
    scheme, _, rest = url.partition("://")
    authority, _, path = rest.partition("/")
    data = json.dumps(doc).encode()
    headers = [("content-type", b"application/json"), ("content-length", str(len(data)).encode())]
    request = http.OutgoingRequest(http.Fields.from_list(headers))
    request.set_method(http.Method_Post())
    request.set_scheme(http.Scheme_Https() if scheme == "https" else http.Scheme_Http())
    request.set_authority(authority)
    request.set_path_with_query("/" + path)
    body = request.body()
    future = outgoing_handler.handle(request, None)
    with body.write() as stream:
        for i in range(0, len(data), 4096):
            stream.blocking_write_and_flush(data[i:i + 4096])
    http.OutgoingBody.finish(body, None)
    # A child resource goes before its parent: the response, then the future.
    with future:
        with future.subscribe() as ready:
            ready.block()
        answer = future.get()  # Optional[Result[Result[IncomingResponse, ErrorCode], None]]
        if not isinstance(answer, Ok) or isinstance(answer.value, Err):
            raise RuntimeError(f"POST {url}: {answer.value.value if isinstance(answer, Ok) else answer}")
        with answer.value.value as response:
            return response.status()


class Tracker(exports.Tracker):
    """The exported `tracker` interface. Return normally for `ok`; raise
    `Err(message)` for `err`. Any other exception traps the instance (hearth
    then starts a fresh one), so each method turns them into `Err`.
    componentize-py makes a new instance of this class for every call: state
    lives on the class (module level), not on `self`."""

    out = None
    url = ""

    def start(self, run, config, options, restart):
        try:
            Tracker.out = open("/logs/steps.jsonl", "a")
        except OSError as e:
            raise Err(f"cannot open /logs/steps.jsonl: {e}")
        Tracker.url = next((v.value for k, v in options if k == "url"), "")
        host.log(host.Level.INFO, f"python tracker: {run.project}/{run.run}, {len(config)} config values")

    def log(self, step, values):
        if Tracker.out is None:
            raise Err("log before start")
        # values: (name, Value_Float | Value_Int | Value_Boolean | Value_Text); each has .value
        row = {"step": step, **{k: v.value for k, v in values}}
        try:
            Tracker.out.write(json.dumps(row) + "\n")
            Tracker.out.flush()
        except (OSError, ValueError) as e:
            raise Err(f"writing /logs/steps.jsonl: {e}")
        if Tracker.url:
            # A server that is down or refuses costs a warning, not the tracker.
            try:
                status = post_json(Tracker.url, row)
                if status >= 300:
                    host.log(host.Level.WARN, f"POST {Tracker.url}: {status}")
            except Exception as e:
                host.log(host.Level.WARN, f"POST {Tracker.url}: {e}")

    def finish(self):
        if Tracker.out is not None:
            Tracker.out.close()
            Tracker.out = None
