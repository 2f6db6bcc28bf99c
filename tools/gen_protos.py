"""Generate the Python gRPC code of every proto under protos/ into services/.

    python tools/gen_protos.py            # regenerate in place
    python tools/gen_protos.py --check    # exit 1 if the committed code is stale

protos/cosine/<service>/v1/<name>.proto becomes services/cosine/<service>/v1/<name>_pb2.py
(+ _pb2_grpc.py, .pyi), so imports between generated files need no rewriting.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services"


def generate(out: Path) -> list[Path]:
    """Run protoc over every proto; returns the generated files relative to out."""
    files = sorted(PROTOS.rglob("*.proto"))
    include = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = []
    for proto in files:
        rel = proto.relative_to(PROTOS).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            generated.append(rel.parent / (rel.name + suffix))
        # every folder of generated code is a package
        pkg = out / rel.parent
        while pkg != out:
            init = pkg / "__init__.py"
            if not init.exists():
                init.write_text("")
            pkg = pkg.parent
    return generated


# lines that only stamp the generator's version (a patch release of grpcio-tools changes them, nothing else)
STAMPS = re.compile(r"^(GRPC_GENERATED_VERSION = .*|# Protobuf Python Version: .*)$", re.MULTILINE)


def same_code(a: Path, b: Path) -> bool:
    """The two generated files say the same, their generator version stamps aside."""
    return STAMPS.sub("", a.read_text()) == STAMPS.sub("", b.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed code instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [rel for rel in generate(Path(tmp)) if not (OUT / rel).exists() or not same_code(Path(tmp) / rel, OUT / rel)]
    if stale:
        print("stale generated code (run python tools/gen_protos.py):", *map(str, stale), sep="\n  ")
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
