"""`weightcache example-engine`: the reference engine the Kubernetes tests deploy.

A small real engine for the packaged all-MiniLM-L6-v2: one call,
`weightcache.integrations.transformers.from_pretrained`, builds the model on the meta
device, gets the weights (from the cache or from disk, per the WEIGHTCACHE_* env the
webhook sets) and binds the model to them without a copy. It keeps the weights (and so its connection to the daemon) for its whole life:
that is how the daemon counts it attached. docs/engines.md walks through the same
steps for other frameworks.

HTTP (standard library):
  GET  /healthz  200 while the process serves
  GET  /ready    200 once the weights are bound, else 503
  GET  /status   which path the weights took (source, reason, attach_ms, ...)
  POST /infer    {"sentences": [...], "output": "mean" | "last_hidden_state"}
                 -> {"embeddings": [[...]]} (mean-pooled) or {"last_hidden_state":
                 [[[...]]]} (each sentence's own tokens), plus "source"
"""

import logging
import os
import pathlib
import threading
import time
from http import HTTPStatus

from .httpjson import BadRequest, JsonHandler, host_port, serve
from .signals import stop_on_signal

log = logging.getLogger("weightcache.engine")

OUTPUTS = ("mean", "last_hidden_state")
MAX_SENTENCES = 64
MAX_SENTENCE_CHARS = 10_000
REQUEST_FIELDS = ("sentences", "output")


def parse_infer(body) -> tuple[list[str], str]:
    """(sentences, output) from a request body, or BadRequest saying what to fix."""
    if not isinstance(body, dict):
        raise BadRequest(f'the body must be a JSON object like {{"sentences": ["..."]}}, not {type(body).__name__}')
    unknown = sorted(set(body) - set(REQUEST_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(REQUEST_FIELDS)}")
    if "sentences" not in body:
        raise BadRequest('missing field "sentences" (a list of strings)')
    sentences = body["sentences"]
    if not isinstance(sentences, list) or not sentences:
        raise BadRequest(f'"sentences" must be a non-empty list of strings, not {type(sentences).__name__}'
                         + (" (empty)" if sentences == [] else ""))
    if len(sentences) > MAX_SENTENCES:
        raise BadRequest(f'"sentences" has {len(sentences)} items; the limit is {MAX_SENTENCES}')
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise BadRequest(f'"sentences"[{i}] must be a string, not {type(s).__name__}')
        if len(s) > MAX_SENTENCE_CHARS:
            raise BadRequest(f'"sentences"[{i}] has {len(s)} characters; the limit is {MAX_SENTENCE_CHARS}')
    output = body.get("output", "mean")
    if output not in OUTPUTS:
        raise BadRequest(f'"output" must be one of {", ".join(OUTPUTS)}, not {output!r}')
    return sentences, output


class Engine:
    """The model and its weights; load() once, then infer() from any thread."""

    def __init__(self, model_dir: pathlib.Path):
        self.model_dir = model_dir
        self.loaded = None  # LoadedWeights: kept open while the engine lives
        self.model = self.tokenizer = None
        self.ready_ms: float | None = None  # from_pretrained: build on meta, get the weights, bind
        self._lock = threading.Lock()  # one forward pass at a time: bounded memory, same results

    @property
    def ready(self) -> bool:
        return self.model is not None

    def load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        from .integrations.transformers import from_pretrained

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        start = time.perf_counter()
        # Built on meta, weights from the cache or disk per WEIGHTCACHE_* (mode, fallback,
        # socket dir, ...), bound without a copy.
        model, loaded = from_pretrained(self.model_dir, AutoModel)
        self.ready_ms = (time.perf_counter() - start) * 1e3
        self.loaded, self.model = loaded, model
        log.info("engine ready", extra={"fields": {"source": loaded.source, "reason": loaded.reason,
                                                   "ready_ms": round(self.ready_ms, 2)}})

    def infer(self, sentences: list[str], output: str) -> dict:
        import torch

        with self._lock, torch.inference_mode():
            inputs = self.tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
            device = next(self.model.parameters()).device  # cpu, or the GPU the cache serves
            inputs = {k: v.to(device) for k, v in inputs.items()}
            hidden = self.model(**inputs).last_hidden_state
            mask = inputs["attention_mask"]
            if output == "last_hidden_state":
                lengths = mask.sum(1).tolist()
                result = [hidden[i, :n].tolist() for i, n in enumerate(lengths)]
            else:
                weights = mask.unsqueeze(-1).to(hidden.dtype)
                result = ((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)).tolist()
        key = "embeddings" if output == "mean" else "last_hidden_state"
        return {key: result, "source": self.loaded.source}

    def status(self) -> dict:
        from weightcache.client.load import engine_report

        doc = {"ready": self.ready, "model": str(self.model_dir), "pid": os.getpid()}
        if self.loaded is not None:
            doc.update(engine_report(self.loaded), ready_ms=round(self.ready_ms, 3))
        return doc

    def close(self) -> None:
        if self.loaded is not None and self.loaded.attached is not None:
            self.loaded.attached.close()


def handler_for(engine: Engine) -> type[JsonHandler]:
    class Handler(JsonHandler):
        def do_GET(self):
            route = self.route()
            if self.answer_probe(route, lambda: engine.ready, engine.status):
                return
            if route == "/infer":
                self.send_error_json(HTTPStatus.METHOD_NOT_ALLOWED, 'use POST /infer with {"sentences": [...]}')
            else:
                self.send_error_json(HTTPStatus.NOT_FOUND, f"no route {route}; try /healthz, /ready, /status, "
                                                           "POST /infer")

        def do_POST(self):
            route = self.route()
            if route != "/infer":
                self.close_connection = True  # the body stays unread
                self.send_error_json(HTTPStatus.NOT_FOUND, f"no route POST {route}; try POST /infer")
                return
            try:
                sentences, output = parse_infer(self.read_json())
            except BadRequest as exc:
                self.send_error_json(exc.status, str(exc))
                return
            if not engine.ready:
                self.send_error_json(HTTPStatus.SERVICE_UNAVAILABLE, "the weights are not bound yet; see /ready")
                return
            try:
                result = engine.infer(sentences, output)
            except Exception as exc:  # a bug or a bad input we did not foresee: say so, keep serving
                log.exception("inference failed")
                self.send_error_json(HTTPStatus.INTERNAL_SERVER_ERROR, f"inference failed: {type(exc).__name__}: {exc}")
                return
            self.send_json(HTTPStatus.OK, result)

    return Handler


def run(args) -> int:
    model_dir = args.model or _default_model()
    engine = Engine(model_dir)
    server = serve(*args.http_bind, handler_for(engine))
    log.info("engine serving", extra={"fields": {"bind": "%s:%d" % server.server_address[:2],
                                                 "model": str(model_dir)}})
    try:
        # SIGTERM keeps its default action while loading (a pod being deleted never
        # waits for a load); once loaded, it stops the server and the process cleanly.
        engine.load()
        stop_on_signal().wait()
        log.info("engine stopping", extra={"fields": {}})
        return 0
    finally:
        server.shutdown()
        server.server_close()
        engine.close()


def _default_model() -> pathlib.Path:
    if os.environ.get("WEIGHTCACHE_MODEL_DIR"):
        return pathlib.Path(os.environ["WEIGHTCACHE_MODEL_DIR"])
    from .demo import packaged_model_dir

    return packaged_model_dir()


def add_command(sub) -> None:
    p = sub.add_parser("example-engine", help="reference engine: MiniLM embeddings over HTTP, weights via the cache",
                       description="Serve the packaged all-MiniLM-L6-v2 (or --model) over HTTP, getting the weights "
                                   "through weightcache.client.load_weights (WEIGHTCACHE_* env: cache or disk) "
                                   "and binding them onto a meta-device model. GET /healthz, /ready, /status; "
                                   'POST /infer {"sentences": [...], "output": "mean"|"last_hidden_state"}.')
    p.add_argument("--model", type=pathlib.Path,
                   help="model directory (default: WEIGHTCACHE_MODEL_DIR, else the packaged all-MiniLM-L6-v2)")
    p.add_argument("--http-bind", required=True, type=host_port, metavar="HOST:PORT", help="where to serve HTTP")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)
