"""Path containment against real daemons: every file the daemon reads resolves inside the
model directory (or, for a Hugging Face cache snapshot, inside its repository).

A symlink corpus: links out (absolute, relative `../`, to /proc/self/environ, a chain
that ends outside), a link to a directory, a FIFO, a shard the index names that links
out, a config.json that links out. Each makes the daemon report an error that names the
file and the rule, while it stays up answering status; no status, log or message ever
holds the bytes of the secret file the links point at (neither its text nor the number
its first 8 bytes make, which is what a length prefix read from it would print).
"""

import hashlib
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cluster.procs import free_port
from procs import wait_until
from test_daemon_http import get
from weightcache.agent import checkpoint_hash
from weightcache.client import CheckpointError, attach, compare_with_disk, list_sockets
from weightcache.client import fingerprint as fp
from weightcache.daemon.checkpoint import read_checkpoint
from weightcache.synthetic import write_model

# What a secret looks like: text, then bytes that decode as nothing.
SECRET = b"hunter2!\x8f\xfe\x01\xc3wc-secret-tail\xff\x00"
SECRET_NUMBER = str(struct.unpack("<Q", SECRET[:8])[0])  # 2392100132157814120
LEAKS = ("hunter2", SECRET_NUMBER, "wc-secret-tail", SECRET[:8].hex(), "\\x8f", "0x8f")
SPECS = {"a": ("F32", (4, 4)), "b": ("BF16", (8,))}
OUTSIDE = "resolves outside the model directory"


@pytest.fixture
def secret(tmp_path) -> pathlib.Path:
    """A small secret file outside the model directory, and a directory beside it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret").write_bytes(SECRET)
    return elsewhere / "secret"


def relink(path: pathlib.Path, target) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


# -- the corpus: each plants one trick in a model; (file named, the rule) ----------------

def absolute_link_out(model, secret):
    relink(model / "model.safetensors", secret)
    return "model.safetensors", OUTSIDE


def relative_link_out(model, secret):
    relink(model / "model.safetensors", "../elsewhere/secret")
    return "model.safetensors", OUTSIDE


def link_to_proc_environ(model, secret):
    relink(model / "model.safetensors", "/proc/self/environ")
    return "model.safetensors", OUTSIDE


def chain_that_ends_outside(model, secret):
    (model / "hop").symlink_to("../elsewhere/hop2")  # a link inside, to a link outside, to the secret
    (secret.parent / "hop2").symlink_to(secret)
    relink(model / "model.safetensors", "hop")
    return "model.safetensors", OUTSIDE


def link_to_a_directory(model, secret):
    (model / "weights").mkdir()
    relink(model / "model.safetensors", "weights")
    return "model.safetensors", "is a directory (a symbolic link), not a regular file"


def fifo(model, secret):
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")  # nobody ever writes it: an open for reading would block
    return "model.safetensors", "is a FIFO, not a regular file"


def indexed_shard_linking_out(model, secret):
    relink(model / "model-00002-of-00002.safetensors", secret)
    return "model-00002-of-00002.safetensors", OUTSIDE


def config_linking_out(model, secret):
    relink(model / "config.json", secret)
    return "config.json", OUTSIDE


def the_secret_copied_in(model, secret):
    """Inside the directory, but not safetensors: refused without quoting its length prefix."""
    (model / "model.safetensors").write_bytes(SECRET)
    return "model.safetensors", "the header length in its first 8 bytes is more than"


def undecodable_header(model, secret):
    raw = b'{"a": "' + SECRET + b'"}'
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return "model.safetensors", "header is not valid JSON in UTF-8 (an undecodable byte at offset"


CORPUS = [absolute_link_out, relative_link_out, link_to_proc_environ, chain_that_ends_outside, link_to_a_directory,
          fifo, indexed_shard_linking_out, config_linking_out, the_secret_copied_in, undecodable_header]
SHARDED = {indexed_shard_linking_out}


def assert_no_leak(*texts):
    for text in texts:
        for leak in LEAKS:
            assert leak not in text, f"{leak!r} leaked into: {text[:2000]}"


def failed_status(port: int) -> dict | None:
    code, body = get(port, "/status")
    doc = json.loads(body) if code == 200 else {}
    return doc if doc.get("state") == "failed" else None


@pytest.mark.parametrize("plant", CORPUS, ids=[f.__name__ for f in CORPUS])
def test_the_daemon_refuses_by_name_stays_up_and_never_echoes_the_file(tmp_path, socket_dir, secret, plant):
    model = write_model(tmp_path / "model", SPECS, shards=2 if plant in SHARDED else 1)
    name, rule = plant(model, secret)
    port, log_path = free_port(), tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "daemon", "--model", str(model),
                                 "--socket-dir", str(socket_dir), "--name", "paths", "--http-bind", f"127.0.0.1:{port}",
                                 "--log-level", "debug"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        doc = wait_until(lambda: failed_status(port), timeout=120, what="the daemon to report a failed load")
        assert doc["reason"] == "InvalidCheckpoint", doc
        assert name in doc["message"] and rule in doc["message"], doc["message"]
        assert get(port, "/healthz")[0] == 200 and failed_status(port) == doc  # up, and still answering
        assert list_sockets(socket_dir) == []
        with pytest.raises(CheckpointError) as refused:  # the same message in-process
            read_checkpoint(model)
        assert str(refused.value) == doc["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert_no_leak(json.dumps(doc), log_path.read_text(errors="backslashreplace"), str(refused.value))


def test_a_link_out_fails_the_clients_fingerprint_with_the_daemons_message(tmp_path, secret):
    model = write_model(tmp_path / "model", SPECS)
    relink(model / "model.safetensors", "../elsewhere/secret")
    with pytest.raises(CheckpointError) as daemon_side:
        read_checkpoint(model)
    with pytest.raises(CheckpointError) as client_side:
        fp.compute(model)
    assert str(client_side.value) == str(daemon_side.value)
    assert str(client_side.value) == (f"model.safetensors {OUTSIDE} {model} (a symbolic link); files must stay "
                                      "inside it")
    assert checkpoint_hash(model) is None  # a store's agent warns and serves on (it only labels caches with it)
    done = subprocess.run([sys.executable, "-m", "weightcache", "attach", "--socket-dir", str(tmp_path / "s"),
                           "--model", str(model), "--json"], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and str(daemon_side.value) in done.stderr, done.stderr
    assert_no_leak(done.stdout, done.stderr)


# -- the Hugging Face cache layout ---------------------------------------------------------

def hf_cache_model(hub: pathlib.Path, source: pathlib.Path, repo="models--org--tiny", rev="0123abcd") -> pathlib.Path:
    """SOURCE's files as the Hugging Face cache keeps them: content-addressed blobs, and
    a snapshot of relative links to them. Returns the snapshot directory."""
    root = hub / repo
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    snapshot = root / "snapshots" / rev
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        data = path.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (snapshot / path.name).symlink_to(f"../../blobs/{blob}")
    return snapshot


def model_fds(pid: int, under: pathlib.Path) -> list[str]:
    """What process PID holds open under UNDER."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(str(under)):
            held.append(target)
    return held


def test_a_hugging_face_cache_snapshot_is_served_bit_identical(tmp_path, socket_dir, daemons, small_model):
    snapshot = hf_cache_model(tmp_path / "hub", small_model)
    proc = daemons.start(snapshot, socket_dir)
    with attach(snapshot, socket_dir=socket_dir, cache_name="test", timeout=60) as attached:
        on_disk = {}
        for shard in sorted(small_model.glob("*.safetensors")):
            on_disk.update(load_file(shard))
        assert attached.tensors.keys() == on_disk.keys()
        for name, tensor in on_disk.items():
            assert torch.equal(attached.tensors[name].reshape(-1).view(torch.uint8),
                               tensor.reshape(-1).view(torch.uint8)), name
        assert compare_with_disk(attached.tensors, snapshot) == []
    # Loaded: the daemon keeps no model file open (the checkpoint's fds end with the load).
    assert model_fds(proc.pid, tmp_path / "hub") == []


def test_a_snapshot_link_out_of_its_repository_is_refused(tmp_path, socket_dir, secret):
    source = write_model(tmp_path / "source", SPECS)
    other = hf_cache_model(tmp_path / "hub", source, repo="models--other--repo")
    snapshot = hf_cache_model(tmp_path / "hub", source)
    # Into another repository's blobs: outside this one, however alike the layout.
    relink(snapshot / "model.safetensors", os.path.relpath((other / "model.safetensors").resolve(), snapshot))
    done = subprocess.run([sys.executable, "-m", "weightcache", "daemon", "--model", str(snapshot),
                           "--socket-dir", str(socket_dir), "--name", "hf"], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, (done.returncode, done.stderr)
    repo = tmp_path / "hub" / "models--org--tiny"
    assert f"model.safetensors resolves outside the model repository {repo}" in done.stderr, done.stderr
    relink(snapshot / "config.json", "../../../../elsewhere/secret")
    with pytest.raises(CheckpointError, match=f"config.json resolves outside the model repository {repo}"):
        read_checkpoint(snapshot)
