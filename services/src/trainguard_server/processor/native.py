"""Build the processor's optional native reader (``_fastread.c`` -> ``_fastread<EXT_SUFFIX>``) with the C
compiler Python was built with. Standard library only: the package's build hook (services/hatch_build.py)
loads this file by path, before any dependency is installed, and ``bench/processor.py`` builds the checkouts
it measures with it.

Optional by design: without a compiler (or Python's headers) :func:`build` returns None and the processor
reads every record through protobuf (decode.read_request_protobuf) -- the same result, slower (~2.5-3
us/event more on the benchmark streams; bench/results/processor_store_issue15_stop42.txt).

    python services/src/trainguard_server/processor/native.py     # build it in place (a source checkout)
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional

SOURCE = Path(__file__).resolve().parent / "_fastread.c"
MODULE = "_fastread"


def target_name() -> str:
    """The extension module's file name for this interpreter (``_fastread.cpython-311-x86_64-linux-gnu.so``
    on CPython 3.11, Linux x86-64)."""
    return MODULE + str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def compile_command(output: Path) -> List[str]:
    """The compiler line: ``$CC``, else Python's ``CC`` (``cc`` when it has none); optimised, shared."""
    cc = shlex.split(os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc"))
    include = sysconfig.get_paths()["include"]
    return [*cc, "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", f"-I{include}", str(SOURCE), "-o",
            str(output)]


def build(dest: Optional[Path] = None, quiet: bool = True) -> Optional[Path]:
    """Compile the reader into ``dest`` (default: beside its source, i.e. in place); the module's path, or
    None when it could not be built (no compiler, no headers: the protobuf path is used)."""
    folder = Path(dest) if dest is not None else SOURCE.parent
    output = folder / target_name()
    folder.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + f".{os.getpid()}.tmp")
    try:
        done = subprocess.run(compile_command(partial), capture_output=quiet, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        if not quiet:
            print(f"native reader not built: {exc}", file=sys.stderr)
        return None
    if done.returncode != 0 or not partial.is_file():
        if not quiet:
            print("native reader not built (the protobuf path will be used)", file=sys.stderr)
        partial.unlink(missing_ok=True)
        return None
    os.replace(partial, output)  # atomic: a process importing it meanwhile sees the old file or the new
    return output


if __name__ == "__main__":
    built = build(quiet=False)
    print(built if built is not None else "not built")
    sys.exit(0 if built is not None else 1)
