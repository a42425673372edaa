"""The files of a model directory in the Hugging Face layout, opened safely and read
without trusting them.

Every file is opened relative to the model directory's fd and must resolve inside the
containment root: the model directory itself, or for a snapshot of the Hugging Face
cache (`<repo>/snapshots/<rev>/*`, links to `../../blobs/*`) the repository `<repo>`.
Links that stay inside are fine; a link out, a FIFO, a device or a directory is refused
naming the file and the rule (docs/model-files.md). A ModelFiles keeps each file it
opened, so that what was validated is what gets loaded: nothing is re-opened by path.

The client reads only what the fingerprint needs (config.json and the raw safetensors
headers); the daemon's checkpoint reader validates everything on top of this. No message
quotes bytes of a file: values parsed from JSON only when short and printable (`shown`),
nothing of a file that failed to parse, no number read from a raw length prefix.
"""

import contextlib
import json
import os
import pathlib
import stat
import struct
import weakref

from .errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SUFFIX = ".safetensors"
# The largest header the safetensors library itself accepts; the JSON files get the same.
MAX_HEADER_BYTES = 100_000_000
MAX_JSON_BYTES = 100_000_000
# A value parsed from a file is quoted in a message up to this length (if printable).
MAX_SHOWN = 64


def shown(value, what: str = "a value") -> str:
    """VALUE (parsed from a file) as a message may quote it: its repr when short and
    printable, otherwise a description ("a tensor name of 300 bytes")."""
    text = repr(value)
    printable = value.isprintable() if isinstance(value, str) else text.isprintable()
    if printable and len(text) <= MAX_SHOWN:
        return text
    if isinstance(value, str):
        return f"{what} of {len(value.encode('utf-8', 'surrogatepass'))} bytes"
    if isinstance(value, (list, dict)):
        return f"a JSON {'list' if isinstance(value, list) else 'object'} of {len(value)} entries"
    return f"a JSON {type(value).__name__} too long to show"


def parse_json(raw: bytes, where: str, what: str = "", *, utf8_only: bool = False):
    """RAW parsed as JSON, or a CheckpointError "WHERE: WHATnot valid JSON (...)" saying
    where parsing stopped, never quoting the text (a UnicodeDecodeError's message quotes
    the byte; json's own messages give a position)."""
    kind = "JSON in UTF-8" if utf8_only else "JSON"

    def bad(detail):
        return CheckpointError(f"{where}: {what}not valid {kind} ({detail})")

    try:
        text = raw.decode("utf-8" if utf8_only else json.detect_encoding(raw))
    except UnicodeDecodeError as exc:
        raise bad(f"an undecodable byte at offset {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # The part before any ": " only: the pure-Python scanner appends the text it
        # tripped on ("Invalid \\escape: 'x'"); line and column say where.
        raise bad(f"{exc.msg.split(': ')[0]}: line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise bad("nested too deeply") from None
    except ValueError as exc:  # an integer of too many digits: the message counts them
        raise bad(str(exc)) from None


def _is_plain_name(name: object) -> bool:
    """One printable name in a directory (so that messages may quote it as it is)."""
    return (isinstance(name, str) and name.isprintable() and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name)


def containment_root(real_dir: str) -> str:
    """The directory every file of the model at REAL_DIR (a resolved path) must stay in:
    REAL_DIR, or for a snapshot of the Hugging Face cache (REAL_DIR is
    `<repo>/snapshots/<rev>` and `<repo>/blobs` is a directory) the repository `<repo>`,
    whose blobs/ the snapshot's files link to. Nothing looser."""
    snapshots = os.path.dirname(real_dir)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and repo != snapshots:
        try:
            if stat.S_ISDIR(os.lstat(os.path.join(repo, "blobs")).st_mode):
                return repo
        except OSError:
            pass
    return real_dir


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _close_all(fds: dict, dir_fd: int) -> None:
    while fds:
        os.close(fds.popitem()[1])
    os.close(dir_fd)


class ModelFiles:
    """The files of one model directory, each opened once, inside the containment root.

    A context manager (or close()); its fds are closed also when it is dropped. The
    daemon's Checkpoint keeps one open until its load ends.
    """

    def __init__(self, model_dir):
        self.model_dir = pathlib.Path(model_dir)
        self._fds: dict[str, int] = {}
        try:
            dir_fd = os.open(self.model_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(f"{self.model_dir}: not a directory; --model must name a model directory") from None
        except OSError as exc:
            raise CheckpointError(f"{self.model_dir}: cannot open the model directory ({exc.strerror})") from None
        self._dir_fd = dir_fd
        self._closer = weakref.finalize(self, _close_all, self._fds, dir_fd)
        try:
            real_dir = self._where(dir_fd, "the model directory")
        except CheckpointError:
            self.close()
            raise
        self.root = containment_root(real_dir)
        # What the messages call the root, and what a Hugging Face snapshot adds to that.
        self._rule, self._note = f"the model directory {self.model_dir}", ""
        if self.root != real_dir:
            self._rule = f"the model repository {self.root}"
            self._note = " (a Hugging Face cache snapshot may link into its repository's blobs/, nowhere else)"

    def __enter__(self) -> "ModelFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    def path(self, name: str) -> pathlib.Path:
        """Where NAME is, for messages and to match a tensor's source with its file."""
        return self.model_dir / name

    def _where(self, fd: int, what: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError as exc:
            raise CheckpointError(f"{self.model_dir}: cannot tell where {what} resolves (/proc/self/fd: "
                                  f"{exc.strerror}); refusing to read what might lie outside it") from None

    def exists(self, name: str) -> bool:
        """Whether the model directory has an entry NAME (a link to nothing counts)."""
        try:
            os.lstat(name, dir_fd=self._dir_fd)
            return True
        except FileNotFoundError:
            return False

    def _is_link(self, name: str) -> bool:
        try:
            return stat.S_ISLNK(os.lstat(name, dir_fd=self._dir_fd).st_mode)
        except OSError:
            return False

    def open(self, name: str) -> int:
        """The fd of NAME (a plain file name in the model directory), opened once: a regular
        file inside the containment root, or a CheckpointError naming NAME and the rule.

        How: the kernel resolves NAME relative to the directory's fd, links and chains of
        links included, into an O_PATH fd, which opens nothing (no FIFO blocks, no device
        sees an open); /proc/self/fd then says where that really is, which must be under
        the root's resolved path, and fstat that it is a regular file. Only then is it
        opened for reading, through that /proc/self/fd entry: the same inode, no path
        resolved again, so nothing can be swapped in between. (Walking the components
        with O_NOFOLLOW would reimplement the kernel's resolution of relative links and
        chains; asking the kernel where it ended is shorter and exact.)
        """
        if name in self._fds:
            return self._fds[name]
        if not _is_plain_name(name):
            raise CheckpointError(f"{self.model_dir}: {shown(name, 'a file name')} is not a plain file name in the "
                                  "model directory")
        link = self._is_link(name)
        try:
            handle = os.open(name, os.O_PATH | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            if link:
                raise CheckpointError(f"{name} in {self.model_dir} is a symbolic link to nothing; files must be "
                                      f"inside {self._rule}{self._note}") from None
            raise CheckpointError(f"{name}: missing from {self.model_dir}") from None
        except OSError as exc:
            raise CheckpointError(f"{name}: cannot open it in {self.model_dir} ({exc.strerror})") from None
        try:
            fd = self._reopen(name, handle, link)
        finally:
            os.close(handle)
        self._fds[name] = fd
        return fd

    def _reopen(self, name: str, handle: int, link: bool) -> int:
        """A readable fd of the file HANDLE (O_PATH) stands for, once it passed the rules."""
        through = " (a symbolic link)" if link else ""
        if not _inside(self._where(handle, name), self.root):
            raise CheckpointError(f"{name} resolves outside {self._rule}{through}; files must stay inside "
                                  f"it{self._note}")
        before = os.fstat(handle)
        if not stat.S_ISREG(before.st_mode):
            raise CheckpointError(f"{name} in {self.model_dir} is {_file_kind(before.st_mode)}{through}, not "
                                  "a regular file; model files must be regular files")
        try:
            fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            raise CheckpointError(f"{name}: cannot read it in {self.model_dir} ({exc.strerror})") from None
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            os.close(fd)  # not reachable through a magic link's reopen; refused all the same
            raise CheckpointError(f"{name} in {self.model_dir} changed while it was opened")
        return fd

    def fd(self, name: str) -> int:
        """The fd of a file opened (and so validated) before; never opens one."""
        try:
            return self._fds[name]
        except KeyError:
            raise CheckpointError(f"{name}: not one of the validated files of {self.model_dir}") from None

    def proc_path(self, name: str) -> str:
        """A path to NAME's open file for libraries that take a path (safetensors): opening
        it opens that same file, whatever the directory holds by now."""
        return f"/proc/self/fd/{self.open(name)}"

    def size(self, name: str) -> int:
        return os.fstat(self.open(name)).st_size

    def pread(self, name: str, nbytes: int, offset: int) -> bytes:
        """Up to NBYTES of NAME from OFFSET (fewer only at the end of the file)."""
        fd, out = self.open(name), bytearray()
        while len(out) < nbytes:
            try:
                chunk = os.pread(fd, nbytes - len(out), offset + len(out))
            except OSError as exc:
                raise CheckpointError(f"{self.path(name)}: cannot read ({exc.strerror})") from None
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def read(self, name: str, limit: int = MAX_JSON_BYTES) -> bytes:
        size = self.size(name)
        if size > limit:
            raise CheckpointError(f"{self.path(name)}: {size} bytes is more than the {limit} this file may have")
        return self.pread(name, size, 0)

    # -- what a model directory holds ------------------------------------------------------
    def config(self) -> dict:
        where = self.path(CONFIG_FILE)
        if not self.exists(CONFIG_FILE):
            raise CheckpointError(f"{where}: missing; a model directory needs config.json")
        config = parse_json(self.read(CONFIG_FILE), str(where))
        if not isinstance(config, dict):
            raise CheckpointError(f"{where}: expected a JSON object, found {type(config).__name__}")
        return config

    def shards(self) -> tuple[list[str], dict[str, str] | None]:
        """The names of the model's safetensors files (each opened), in a stable order, and
        the index's weight map. With an index, exactly the shards it names (each must
        exist); without one, every *.safetensors entry of the directory."""
        if not self.exists(INDEX_FILE):
            names = sorted(e.name for e in os.scandir(self._dir_fd) if e.name.endswith(SUFFIX))
            if not names:
                raise CheckpointError(f"{self.model_dir}: no *.safetensors files and no {INDEX_FILE}")
            for name in names:
                self.open(name)
            return names, None
        where = str(self.path(INDEX_FILE))
        index = parse_json(self.read(INDEX_FILE), where, "not a valid safetensors index: ")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{where}: not a valid safetensors index (expected a JSON object whose "
                                  "\"weight_map\" is an object of tensor name -> shard file)")
        # Few distinct shards name many tensors: check each name once. A value that is not
        # a string (any JSON may appear) is refused by _check_shard_name.
        try:
            distinct = set(weight_map.values())
        except TypeError:  # a list or an object: unhashable, and no file name either
            distinct = [next(f for f in weight_map.values() if not isinstance(f, str))]
        names = sorted(_check_shard_name(f, where) for f in distinct)
        missing = [n for n in names if not self.exists(n)]
        if missing:
            raise CheckpointError(f"{where}: shard(s) missing from {self.model_dir}: {', '.join(missing)}")
        for name in names:
            self.open(name)
        return names, weight_map  # JSON object keys are always strings

    def raw_header(self, name: str) -> bytes:
        """The JSON header bytes of a safetensors file, bounds-checked but not parsed."""
        path, size = self.path(name), self.size(name)
        prefix = self.pread(name, 8, 0)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            # Never the length itself: it is the file's first 8 bytes, whatever the file is.
            raise CheckpointError(f"{path}: the header length in its first 8 bytes is more than the {size - 8} "
                                  f"bytes after them or the limit of {MAX_HEADER_BYTES}; the file is truncated or "
                                  "not safetensors")
        raw = self.pread(name, length, 8)
        if len(raw) < length:
            raise CheckpointError(f"{path}: the file shrank while its header was read")
        return raw


def _check_shard_name(name: object, source: str) -> str:
    """A shard named by the index must be a plain '*.safetensors' file name."""
    if not _is_plain_name(name) or not name.endswith(SUFFIX):
        raise CheckpointError(f"{source}: shard name {shown(name, 'a name')} is not allowed; expected a plain "
                              "'*.safetensors' file name in the model directory")
    return name


def opened(model) -> contextlib.AbstractContextManager:
    """The ModelFiles of MODEL for a with-block: an open one as it is (its owner closes
    it), or a model directory, opened for the block."""
    return contextlib.nullcontext(model) if isinstance(model, ModelFiles) else ModelFiles(model)


def read_config(model) -> dict:
    """config.json of MODEL (a model directory or an open ModelFiles)."""
    with opened(model) as files:
        return files.config()
