"""The `weightcache` command: daemon, attach, status, demo."""

import argparse
import json
import os
import pathlib
import sys

from . import agent, demo, example_engine, logs
from .httpjson import host_port
from .operator import main as operator_main
from .operator import uninstall as operator_uninstall

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def _add_tp(p):
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--tp-rank", type=int, default=0, help="this cache's tensor-parallel rank")


def _parallel(args):
    from weightcache.client import Parallelism

    return Parallelism(tp_size=args.tp_size, tp_rank=args.tp_rank)


def _add_daemon(sub):
    p = sub.add_parser("daemon", help="load a model (or hold what engines publish) and serve it over a Unix socket",
                       description="Load a model's weights once into sealed slabs and serve them to engines "
                                   "over a Unix socket until SIGTERM. Without --model the daemon is a store: it "
                                   "starts empty and serves what engines in their own layout (vLLM) publish "
                                   "into it (--allow-publish-uid/--allow-publish-gid).")
    p.add_argument("--model", type=pathlib.Path,
                   help="model directory (config.json, *.safetensors); omit for a store that engines publish into")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda-vmm", "cuda-ipc"], help="memory backend (default: cpu)")
    p.add_argument("--device", action="append", dest="devices",
                   help="GPU UUID or ordinal for the GPU backends, repeatable, or 'all' (default: 0); one socket "
                        "per device, and with several devices device i serves tensor-parallel rank i %% --tp-size")
    p.add_argument("--socket-dir", required=True, type=pathlib.Path, help="directory for the daemon's sockets")
    p.add_argument("--name", help="cache name (default: the model directory's name)")
    p.add_argument("--revision", default="", help="model revision recorded in the fingerprint")
    _add_tp(p)
    p.add_argument("--tp-plan", type=pathlib.Path,
                   help="JSON tensor-parallel plan (module pattern -> colwise|rowwise|...); "
                        "default: the config's base_model_tp_plan")
    p.add_argument("--allow-uid", type=int, action="append", default=[],
                   help="peer uid allowed to connect (repeatable; default: the daemon's own uid)")
    p.add_argument("--allow-gid", type=int, action="append", default=[], help="peer gid allowed to connect (repeatable)")
    p.add_argument("--allow-publish-uid", type=int, action="append", default=[],
                   help="a store's writers: peer uid allowed to publish (repeatable; default: nobody). Attaching "
                        "needs --allow-uid/--allow-gid; publishing needs this, and a reader can never publish")
    p.add_argument("--allow-publish-gid", type=int, action="append", default=[],
                   help="peer gid allowed to publish into a store (repeatable)")
    p.add_argument("--commit-timeout", type=float, default=600.0,
                   help="seconds a writer has from receiving its slabs to committing them (default 600); a "
                        "publication not committed in time is dropped and freed")
    p.add_argument("--socket-group", type=int,
                   help="share the socket directory (0750) and sockets (0660) with this gid; default private (0700/0600)")
    p.add_argument("--handshake-timeout", type=float, default=5.0, help="seconds a client has to send its request")
    p.add_argument("--max-connections", type=int, default=1024, help="concurrent connections before refusing")
    p.add_argument("--max-slab-mib", type=int, default=8192,
                   help="largest slab in MiB (larger tensors get their own); each slab is one handle to import")
    p.add_argument("--load-workers", type=int, default=16, help="parallel file readers during the cold load")
    p.add_argument("--ready-fd", type=int, help="write 'ready' to this inherited fd once serving")
    p.add_argument("--take-over", action="store_true",
                   help="if a live daemon serves this cache and device, take its resident slabs over its socket "
                        "(nothing is read from disk), publish, and let it exit, or with its --http-bind wait for "
                        "SIGTERM (a daemon upgrade without a reload); with none to take over from, load")
    p.add_argument("--max-device-bytes", type=int, metavar="BYTES",
                   help="refuse (reason OverBudget, before allocating) a shard larger than this per device; the "
                        "operator sets it to what a per-GPU budget leaves beside a generation already resident")
    p.add_argument("--http-bind", type=host_port, metavar="HOST:PORT",
                   help="serve /healthz, /readyz, /metrics and /status here; a failed load then keeps the daemon "
                        "up, reporting why, instead of exiting")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_cmd_daemon)


def _cmd_daemon(args) -> int:
    from weightcache.client.load import default_cache_name
    from weightcache.daemon.service import DaemonConfig, run

    uids = frozenset(args.allow_uid) or frozenset({os.geteuid()})
    if args.model is None and not args.name:
        raise ValueError("a store (no --model) needs --name")
    if args.model is None and not (args.allow_publish_uid or args.allow_publish_gid):
        raise ValueError("a store (no --model) needs writers: --allow-publish-uid or --allow-publish-gid")
    config = DaemonConfig(
        model_dir=args.model.resolve() if args.model else None, socket_dir=args.socket_dir,
        name=args.name or default_cache_name(args.model),
        backend=args.backend, devices=tuple(args.devices or ["0"]), revision=args.revision, parallel=_parallel(args),
        tp_plan=args.tp_plan, allow_uids=uids, allow_gids=frozenset(args.allow_gid),
        socket_group=args.socket_group, handshake_timeout=args.handshake_timeout,
        max_connections=args.max_connections, max_slab_bytes=args.max_slab_mib << 20, load_workers=args.load_workers,
        http_bind=args.http_bind, take_over=args.take_over, max_device_bytes=args.max_device_bytes,
        allow_publish_uids=frozenset(args.allow_publish_uid), allow_publish_gids=frozenset(args.allow_publish_gid),
        commit_timeout=args.commit_timeout,
    )
    return run(config, ready_fd=args.ready_fd)


def _add_attach(sub):
    p = sub.add_parser("attach", help="attach to a daemon as an engine would, and report",
                       description="Attach to the daemon serving --model, build every tensor as a view, and "
                                   "print what was attached. Exits non-zero on any failure or mismatch.")
    p.add_argument("--socket-dir", required=True, type=pathlib.Path)
    p.add_argument("--model", required=True, type=pathlib.Path, help="the model directory the engine would load")
    p.add_argument("--cache", help="cache name (default: any cache serving this fingerprint)")
    p.add_argument("--device", default="cpu", help="'cpu' or a GPU UUID")
    p.add_argument("--revision", default="")
    _add_tp(p)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--verify", action="store_true", help="compare every tensor's bytes with the files on disk")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_attach)


def _cmd_attach(args) -> int:
    from weightcache.client import attach, compare_with_disk
    from weightcache.client.fingerprint import digest

    if args.verify and args.tp_size > 1:
        raise ValueError("--verify compares with whole tensors on disk; it cannot check a tensor-parallel shard")
    with attach(args.model, socket_dir=args.socket_dir, cache_name=args.cache, device=args.device,
                revision=args.revision, parallel=_parallel(args), timeout=args.timeout,
                client_name="weightcache-attach") as att:
        problems = compare_with_disk(att.tensors, args.model) if args.verify else None
        result = {
            "attach_ms": round(att.attach_ms, 3), "tensors": len(att.tensors), "bytes": att.resident_bytes,
            "fingerprint": digest(att.fingerprint), "verified": None if problems is None else not problems,
            "socket": att.socket_path, "phases_ms": {k: round(v, 3) for k, v in att.phases_ms.items()},
        }
        if problems:
            result["mismatches"] = problems[:20]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"attached {result['tensors']} tensors, {result['bytes']} bytes in {result['attach_ms']} ms "
              f"from {result['socket']}" + ("" if problems is None else f"; verified: {not problems}"))
        for line in problems or []:
            print(f"  mismatch: {line}")
    return EXIT_FAILED if problems else 0


def _add_status(sub):
    p = sub.add_parser("status", help="show every cache served in a socket directory",
                       description="Handshake with every daemon socket in --socket-dir and print what each serves.")
    p.add_argument("--socket-dir", required=True, type=pathlib.Path)
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args) -> int:
    from google.protobuf.json_format import MessageToDict

    from weightcache.client import list_sockets, query_status
    from weightcache.client.errors import WeightCacheError

    rows = []
    for path in list_sockets(args.socket_dir):
        try:
            s = query_status(path)
        except (WeightCacheError, OSError, EOFError) as exc:
            rows.append({"socket": str(path), "state": "unreachable", "error": str(exc) or type(exc).__name__})
            continue
        rows.append({"socket": str(path), "state": "ready", "name": s.cache_name, "fingerprint": s.fingerprint_digest,
                     "backend": s.backend, "device": s.device, "tensors": s.tensors, "bytes": s.resident_bytes,
                     "attached_clients": s.attached_clients, "uptime_s": round(s.uptime_s, 3), "pid": s.pid,
                     "model": s.model_path, "load_s": round(s.load_s, 3),
                     "fingerprint_fields": MessageToDict(s.fingerprint, preserving_proto_field_name=True,
                                                         always_print_fields_with_no_presence=True)})
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print(f"no caches in {args.socket_dir}")
    else:
        print(f"{'NAME':<24} {'DEVICE':<10} {'BACKEND':<8} {'TENSORS':>8} {'BYTES':>14} {'CLIENTS':>7} {'UPTIME':>9}  FINGERPRINT")
        for r in rows:
            if r["state"] != "ready":
                print(f"{r['socket']}: unreachable: {r['error']}")
                continue
            print(f"{r['name']:<24} {r['device'][:10]:<10} {r['backend']:<8} {r['tensors']:>8} {r['bytes']:>14} "
                  f"{r['attached_clients']:>7} {r['uptime_s']:>8.0f}s  {r['fingerprint'][:12]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightcache", description="Node-local GPU weight cache for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_daemon, _add_attach, _add_status, demo.add_command, agent.add_command, example_engine.add_command,
                operator_main.add_command, operator_uninstall.add_command):
        add(sub)
    return parser


def main(argv=None) -> int:
    from weightcache.client.errors import CheckpointError, WeightCacheError

    args = build_parser().parse_args(argv)
    logs.configure(getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except (CheckpointError, ValueError, OSError) as exc:
        _fail(args, exc)
        return EXIT_BAD_INPUT
    except WeightCacheError as exc:
        _fail(args, exc)
        return EXIT_FAILED


def _fail(args, exc) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    print(f"weightcache {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
