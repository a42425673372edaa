import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_wire_module_matches_the_proto(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    assert (tmp_path / "wire_pb2.py").read_text() == (ROOT / "client" / "wire_pb2.py").read_text(), \
        "client/wire_pb2.py is stale: run `make proto` and commit it"


def test_the_client_imports_nothing_from_the_daemon_or_operator():
    code = ("import sys, weightcache.client; "
            "bad = [m for m in sys.modules if m.startswith(('weightcache.daemon', 'weightcache.operator'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_is_importable_as_a_top_level_operator_package():
    result = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    assert "weightcache" not in result.stdout and str(ROOT / "operator") not in result.stdout
