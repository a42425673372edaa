"""Generate client/wire_pb2.py from proto/weightcache/v1/wire.proto.

Run by `make proto`; tests/unit/test_wire_generated.py runs it into a temporary folder
and checks the committed module is current. The file keeps its full proto path
(weightcache/v1/wire.proto) so it cannot collide in protobuf's global descriptor pool
with another library's wire.proto.
"""

import argparse
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
SOURCE = "weightcache/v1/wire.proto"


def generate(out_dir: pathlib.Path) -> pathlib.Path:
    """Write wire_pb2.py into out_dir and return its path."""
    with tempfile.TemporaryDirectory() as tmp:
        status = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", SOURCE])
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {SOURCE}")
        target = out_dir / "wire_pb2.py"
        shutil.copyfile(pathlib.Path(tmp) / "weightcache/v1/wire_pb2.py", target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT.parent / "client")
    args = parser.parse_args()
    print(generate(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
