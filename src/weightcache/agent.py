"""`weightcache agent`: the sidecar that gates an engine's start on the node's cache.

The webhook runs it as a native sidecar beside every engine container. It is Ready
once a daemon of the cache answers a status handshake on its socket and the weights
it serves are the ones --model names (the model-level fingerprint fields; the agent
has no GPU, so device and torch fields are the engine's attach to check). Until then
the kubelet holds the engine back. It gives up with a reason the pod status shows:

  exit 3  a daemon answered, but for other weights (each differing field, both values)
  exit 4  no daemon answered within --wait-timeout (what each socket answered)

Once ready it keeps checking: a daemon that goes away turns /ready to 503 and /status
says why; the agent does not exit (attached engines keep their memory either way).
HTTP: GET /ready, /healthz, /status (cache state, the daemon's fingerprint digest,
attached clients, and the engine's report from --report-file).

With --store (a WeightCache of source Published) the node's daemon is a store that
engines publish into, and what an engine will ask it for is the engine's own
fingerprint (vLLM's, with its version and settings), which the agent cannot compute.
It is Ready once a store of the cache answers the status handshake on its
`<cache>__<device>__published.sock`, empty or not: the first engine on the node
publishes, later ones attach. /status lists what the store holds (each cache's engine,
fingerprint, bytes, attached engines, and whether it was made from --model's
checkpoint), and the engine's report says which it did (`published` or `cache`).
"""

import json
import logging
import pathlib
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http import HTTPStatus

from weightcache.client import fingerprint as fp
from weightcache.client.attach import list_sockets, query_status
from weightcache.client.errors import WeightCacheError
from weightcache.client.modelfiles import read_config
from weightcache.client.protocol import LAYOUT_VERSION, STORE_TAG, parse_socket_name

from .httpjson import JsonHandler, host_port, serve
from .signals import stop_on_signal

log = logging.getLogger("weightcache.agent")

EXIT_MISMATCH = 3
EXIT_TIMEOUT = 4
READY, NO_SOCKET, NO_ANSWER, MISMATCH = "Ready", "NoSocket", "NoDaemonAnswered", "FingerprintMismatch"
# What the weights are, as opposed to where they live (device kind, compute capability,
# driver, torch version, ranks): those the engine's own attach checks on its GPU.
MODEL_FIELDS = ("model_hash", "revision", "quantization", "quantization_config_hash", "dtype", "tp_size",
                "layout_version")


# -- what must agree --------------------------------------------------------------------
def expected_fields(model_dir: pathlib.Path, revision: str, tp_size: int | None) -> dict:
    """The model-level fingerprint fields an engine loading MODEL_DIR will send.

    The same values fingerprint.compute() gives (a test pins that), without importing
    torch: the agent runs in every engine pod and should cost little memory and time.
    tp_size is compared only when the caller knows it.
    """
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model {model_dir}: no such directory (is the model volume mounted?)")
    config = read_config(model_dir)
    quantization, quantization_hash = fp.quantization_of(config)
    fields = {"model_hash": fp.model_hash(model_dir), "revision": revision, "quantization": quantization,
              "quantization_config_hash": quantization_hash,
              "dtype": str(config.get("torch_dtype") or config.get("dtype") or ""),
              "tp_size": tp_size, "layout_version": LAYOUT_VERSION}
    return {name: fields[name] for name in MODEL_FIELDS if fields[name] is not None}


@dataclass
class Answer:
    """What one socket of the cache answered."""

    socket: str
    state: str  # "match" | "mismatch" | "unreachable"
    message: str
    mismatches: list = field(default_factory=list)  # [field, expected, daemon's] each
    daemon: dict | None = None  # the daemon's own account, when it answered


def ask(path: pathlib.Path, expected: dict, timeout: float) -> Answer:
    """Handshake with one socket and compare what it serves with EXPECTED."""
    try:
        status = query_status(path, timeout=timeout)
    except ConnectionRefusedError:
        return Answer(path.name, "unreachable", f"{path.name}: no daemon listening (a stale socket file)")
    except FileNotFoundError:
        return Answer(path.name, "unreachable", f"{path.name}: gone while asking (a daemon stopping)")
    except (WeightCacheError, OSError, EOFError) as exc:
        return Answer(path.name, "unreachable", f"{path.name}: {type(exc).__name__}: {exc}")
    daemon = {"socket": str(path), "fingerprint": status.fingerprint_digest, "device": status.device,
              "backend": status.backend, "pid": status.pid, "attached_clients": status.attached_clients,
              "tensors": status.tensors, "resident_bytes": status.resident_bytes,
              "uptime_s": round(status.uptime_s, 3), "model": status.model_path}
    served = fp.fields(status.fingerprint)
    mismatches = [[name, value, served[name]] for name, value in expected.items() if served[name] != value]
    if mismatches:
        detail = "; ".join(f"{name}: --model gives {want!r}, daemon has {got!r}" for name, want, got in mismatches)
        return Answer(path.name, "mismatch", f"{path.name}: {detail}", mismatches, daemon)
    return Answer(path.name, "match", f"{path.name}: serves these weights", [], daemon)


@dataclass
class Verdict:
    ready: bool
    reason: str  # CamelCase, as Kubernetes conditions have it
    message: str
    answers: list


def judge(answers: list[Answer], cache: str, socket_dir) -> Verdict:
    """Ready if any socket serves these weights; a daemon that answered for other weights
    outranks silent sockets in saying why not."""
    if any(a.state == "match" for a in answers):
        return Verdict(True, READY, f"cache {cache} is ready", answers)
    if not answers:
        return Verdict(False, NO_SOCKET, f"no socket of cache {cache} in {socket_dir} (is the cache's daemon "
                                         "running on this node?)", answers)
    wrong = [a for a in answers if a.state == "mismatch"]
    if wrong:
        return Verdict(False, MISMATCH, f"the daemon of cache {cache} serves other weights than --model: "
                                        + " | ".join(a.message for a in wrong), answers)
    return Verdict(False, NO_ANSWER, f"no daemon of cache {cache} answered: "
                                     + " | ".join(a.message for a in answers), answers)


def is_store_socket(path: pathlib.Path) -> bool:
    parsed = parse_socket_name(path.name)
    return parsed is not None and parsed[2] == STORE_TAG


def store_caches(status, model_hash: str | None) -> list[dict]:
    """What a store's Status says it holds, one entry per published cache."""
    out = []
    for c in status.caches:
        f = fp.fields(c.fingerprint)
        out.append({"fingerprint": c.fingerprint_digest, "engine": f["engine"], "engine_version": f["engine_version"],
                    "dtype": f["dtype"], "tp_size": f["tp_size"], "tp_rank": f["tp_rank"], "tensors": c.tensors,
                    "resident_bytes": c.resident_bytes, "attached_clients": c.attached_clients,
                    "age_s": round(c.age_s, 3),
                    "of_this_model": None if model_hash is None else f["model_hash"] == model_hash})
    return out


def ask_store(path: pathlib.Path, model_hash: str | None, timeout: float) -> Answer:
    """Handshake with one store socket: a store that answers is all readiness needs."""
    try:
        status = query_status(path, timeout=timeout)
    except ConnectionRefusedError:
        return Answer(path.name, "unreachable", f"{path.name}: no store listening (a stale socket file)")
    except FileNotFoundError:
        return Answer(path.name, "unreachable", f"{path.name}: gone while asking (a store stopping)")
    except (WeightCacheError, OSError, EOFError) as exc:
        return Answer(path.name, "unreachable", f"{path.name}: {type(exc).__name__}: {exc}")
    caches = store_caches(status, model_hash)
    daemon = {"socket": str(path), "store": status.store, "device": status.device, "backend": status.backend,
              "pid": status.pid, "attached_clients": status.attached_clients, "resident_bytes": status.resident_bytes,
              "budget_bytes": status.budget_bytes, "uptime_s": round(status.uptime_s, 3), "caches": caches,
              "fingerprint": ""}
    if not status.store:
        return Answer(path.name, "unreachable", f"{path.name}: answers, but is not a store", [], daemon)
    held = f"{len(caches)} published cache(s)" if caches else "empty: the first engine on the node publishes"
    return Answer(path.name, "match", f"{path.name}: store serves; {held}", [], daemon)


def check(socket_dir, cache: str, expected: dict, timeout: float, store: bool = False,
          model_hash: str | None = None) -> Verdict:
    """Checkpoint caches: every socket of the cache but a store's; stores: only theirs."""
    paths = [p for p in list_sockets(socket_dir, cache) if is_store_socket(p) == store]
    if store:
        return judge([ask_store(p, model_hash, timeout) for p in paths], cache, socket_dir)
    return judge([ask(p, expected, timeout) for p in paths], cache, socket_dir)


# -- the running agent ------------------------------------------------------------------
def _stamp(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class Agent:
    """The latest verdict, shared between the checking loop and the HTTP threads."""

    def __init__(self, args, expected: dict, model_hash: str | None = None):
        self.args, self.expected, self.model_hash = args, expected, model_hash
        self._lock = threading.Lock()
        self.verdict = Verdict(False, NO_SOCKET, "not checked yet", [])
        self.checked_at: float | None = None
        self.ready_since: float | None = None
        self.ever_ready = False

    def refresh(self) -> Verdict:
        verdict = check(self.args.socket_dir, self.args.cache, self.expected, self.args.handshake_timeout,
                        store=self.args.store, model_hash=self.model_hash)
        with self._lock:
            before, self.verdict, self.checked_at = self.verdict, verdict, time.time()
            if verdict.ready and not before.ready:
                self.ready_since, self.ever_ready = self.checked_at, True
            elif not verdict.ready:
                self.ready_since = None
        if (verdict.ready, verdict.reason, verdict.message) != (before.ready, before.reason, before.message):
            self._log_change(verdict)
        return verdict

    def _log_change(self, verdict: Verdict) -> None:
        fields = {"cache": self.args.cache, "reason": verdict.reason, "detail": verdict.message}
        if verdict.ready:
            match = next(a for a in verdict.answers if a.state == "match")
            log.info("cache ready", extra={"fields": {**fields, "fingerprint": match.daemon["fingerprint"] or "store"}})
        elif self.ever_ready:
            log.warning("cache not ready", extra={"fields": fields})
        else:
            log.info("waiting for the cache", extra={"fields": fields})

    def status(self) -> dict:
        with self._lock:
            v, checked_at, ready_since = self.verdict, self.checked_at, self.ready_since
        matching = [a.daemon for a in v.answers if a.state == "match"]
        doc = {"cache": self.args.cache, "ready": v.ready, "reason": v.reason, "message": v.message,
               "socket_dir": str(self.args.socket_dir), "model": str(self.args.model), "expected": self.expected,
               "daemon": matching[0] if matching else None,
               "attached_clients": sum(d["attached_clients"] for d in matching),
               "store": self.args.store,
               "sockets": [asdict(a) for a in v.answers],
               "checked_at": _stamp(checked_at), "ready_since": _stamp(ready_since), "engine": None}
        if self.args.store:
            doc["caches"] = [c for d in matching for c in d["caches"]]
        doc.update(read_report(self.args.report_file))
        return doc


def read_report(path: pathlib.Path | None) -> dict:
    """{"engine": the engine's report} (None until the engine writes it), plus
    "engine_report_error" when the file cannot be used. The engine writes it by rename,
    so it is never seen half-written."""
    if path is None:
        return {}
    try:
        return {"engine": json.loads(path.read_bytes())}
    except FileNotFoundError:
        return {"engine": None}
    except (OSError, ValueError) as exc:
        return {"engine": None, "engine_report_error": f"{path}: {exc}"}


def handler_for(agent: Agent) -> type[JsonHandler]:
    class Handler(JsonHandler):
        def do_GET(self):
            route = self.route()
            if not self.answer_probe(route, lambda: agent.verdict.ready, agent.status):
                self.send_error_json(HTTPStatus.NOT_FOUND, f"no route {route}; try /ready, /healthz, /status")

    return Handler


def checkpoint_hash(model_dir: pathlib.Path | None) -> str | None:
    """The model hash of MODEL_DIR's checkpoint, or None when there is none to read."""
    try:
        return fp.model_hash(model_dir) if model_dir is not None and model_dir.is_dir() else None
    except (OSError, ValueError, WeightCacheError) as exc:  # a refused file too (docs/model-files.md)
        log.warning("cannot hash --model", extra={"fields": {"model": str(model_dir), "error": str(exc)}})
        return None


def run(args) -> int:
    if args.store:
        # Only to say which published caches were made from this checkpoint; a store
        # is ready without it (the engine may also be pointed at another directory).
        expected, model_hash = {}, checkpoint_hash(args.model)
    else:
        if args.model is None:
            raise SystemExit("weightcache agent: --model is required unless --store")
        expected, model_hash = expected_fields(args.model, args.revision, args.tp_size), None
    agent = Agent(args, expected, model_hash)
    server = serve(*args.http_bind, handler_for(agent))
    log.info("agent serving", extra={"fields": {"bind": "%s:%d" % server.server_address[:2], "cache": args.cache,
                                                "socket_dir": str(args.socket_dir)}})
    stop = stop_on_signal()
    deadline = time.monotonic() + args.wait_timeout
    try:
        while not stop.is_set():
            verdict = agent.refresh()
            if not agent.ever_ready:
                if verdict.reason == MISMATCH:
                    return give_up(args, agent, EXIT_MISMATCH)
                if time.monotonic() >= deadline:
                    return give_up(args, agent, EXIT_TIMEOUT)
            stop.wait(args.poll_interval if agent.ever_ready
                      else max(0.0, min(args.poll_interval, deadline - time.monotonic())))
        return 0
    finally:
        server.shutdown()
        server.server_close()


def give_up(args, agent: Agent, code: int) -> int:
    """Say why on stdout (--json) and stderr, last, so the tail of the container's log
    (FallbackToLogsOnError) carries it into the pod status."""
    doc = agent.status()
    v = agent.verdict
    if args.json:
        print(json.dumps({**doc, "exit_code": code}), flush=True)
    if code == EXIT_MISMATCH:
        lines = [f"weightcache agent: {MISMATCH}: the daemon of cache {args.cache} serves other weights than "
                 f"--model {args.model} --revision {args.revision!r}; the engine would not attach:"]
        lines += [f"  {a.socket}: {name}: --model gives {want!r}, daemon has {got!r}"
                  for a in v.answers if a.state == "mismatch" for name, want, got in a.mismatches]
    else:
        lines = [f"weightcache agent: {v.reason}: no ready daemon of cache {args.cache} in {args.socket_dir} "
                 f"after {args.wait_timeout:g}s (--wait-timeout)"]
        lines += [f"  {a.message}" for a in v.answers] or ["  no socket of the cache appeared"]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code


def add_command(sub) -> None:
    p = sub.add_parser("agent", help="sidecar: gate an engine's start until the node's cache is ready",
                       description="Serve /ready once a daemon of --cache answers on its socket and serves the "
                                   "weights --model names (model hash, revision, quantization, dtype, layout). "
                                   f"Exits {EXIT_MISMATCH} naming each differing field when it serves others, "
                                   f"{EXIT_TIMEOUT} when none answers within --wait-timeout; once ready it keeps "
                                   "checking and reports on /ready and /status without exiting.")
    p.add_argument("--socket-dir", required=True, type=pathlib.Path, help="the cache's socket directory")
    p.add_argument("--cache", required=True, help="cache name (the WeightCache's name)")
    p.add_argument("--model", type=pathlib.Path,
                   help="the model directory the engine loads (required unless --store)")
    p.add_argument("--store", action="store_true",
                   help="the cache is a store engines publish into (WeightCache source Published): ready once a "
                        "store of --cache answers; /status lists what it holds")
    p.add_argument("--revision", default="", help="model revision the engine expects")
    p.add_argument("--tp-size", type=int, help="tensor-parallel size the engine expects (compared when given)")
    p.add_argument("--http-bind", required=True, type=host_port, metavar="HOST:PORT",
                   help="serve /ready, /healthz and /status here")
    p.add_argument("--report-file", type=pathlib.Path,
                   help="the engine's report (WEIGHTCACHE_REPORT_FILE), served on /status")
    p.add_argument("--wait-timeout", type=float, default=600.0,
                   help=f"seconds to wait for a ready daemon before exiting {EXIT_TIMEOUT} (default 600)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between checks (default 1)")
    p.add_argument("--handshake-timeout", type=float, default=5.0, help="seconds one socket has to answer")
    p.add_argument("--json", action="store_true", help="on giving up, print the status as one JSON object")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
