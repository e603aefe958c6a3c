"""Generate the Python gRPC stubs from protos/ into the `pdserve.v1` package (`make protos`).

The stubs are checked in; tests/test_protos.py regenerates them into a temporary folder and fails
when the checked-in ones differ, so a proto edit without `make protos` does not land.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = Path("pdserve") / "v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir/pdserve/v1; return their paths."""
    import grpc_tools

    out_dir = Path(out_dir).resolve()
    (out_dir / PACKAGE).mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    # In its own process: protoc's C++ (protobuf, abseil) crashes a process that has loaded
    # NIXL's libraries (the tests load both), and cwd is the proto root there, which protoc
    # resolves the relative proto paths against.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from grpc_tools import protoc; sys.exit(protoc.main(sys.argv[1:]))",
        ]
        + args,
        cwd=PROTO_ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError("protoc failed: " + " ".join(args) + "\n" + done.stderr)
    for init in (out_dir / "pdserve" / "__init__.py", out_dir / PACKAGE / "__init__.py"):
        if not init.exists():
            init.write_text('"""Generated gRPC stubs (`make protos`); do not edit."""\n')
    return sorted(p for p in (out_dir / PACKAGE).iterdir() if p.name != "__init__.py" and p.is_file())


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
