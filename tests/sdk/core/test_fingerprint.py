"""fp:v1: message templates, library/in-app frames, frame selection and hints, and the contract that a
live exception and the text Python printed for it have one fingerprint."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable, List

import pytest

from trainguard.core import fingerprint as fp_module
from trainguard.core.fingerprint import (
    FINGERPRINT_VERSION,
    MAX_FRAMES,
    FrameInfo,
    canonical_input,
    exception_type_name,
    fingerprint,
    fingerprint_exception,
    frames_from_traceback,
    is_library_path,
    is_stdlib_path,
    module_from_filename,
    normalize_message,
)
from trainguard.core.tracebacks import fingerprint_text

REPO = Path(__file__).resolve().parents[3]
SITE = "/opt/venv/lib/python3.11/site-packages"


def app(function: str, module: str = "train", lineno: int = 1) -> FrameInfo:
    return FrameInfo(f"/home/me/{module}.py", module, function, lineno, True)


def lib(function: str, module: str = "torch.nn.functional", lineno: int = 1) -> FrameInfo:
    return FrameInfo(f"{SITE}/{module.replace('.', '/')}.py", module, function, lineno, False)


def std(function: str, module: str = "threading") -> FrameInfo:
    return FrameInfo(f"/usr/lib/python3.11/{module.replace('.', '/')}.py", module, function, 1, False)


# ------------------------------------------------------------------------------------------------------
# Message templates


@pytest.mark.parametrize(
    ("message", "template"),
    [
        (
            "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB "
            "of which 3.19 MiB is free.",
            "CUDA out of memory. Tried to allocate <size>. GPU <num> has a total capacity of <size> "
            "of which <size> is free.",
        ),
        (
            "Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.12 GiB already allocated)",
            "Tried to allocate <size> (GPU <num>; <size> total capacity; <size> already allocated)",
        ),
        (
            "mat1 and mat2 shapes cannot be multiplied (8x32 and 16x4)",
            "mat1 and mat2 shapes cannot be multiplied (<shape> and <shape>)",
        ),
        (
            "Expected size [32, 128] but got torch.Size([16, 128])",
            "Expected size <shape> but got torch.Size(<shape>)",
        ),
        (
            "shape '(4, 8)' is invalid for input of size 64",
            "shape '<shape>' is invalid for input of size <num>",
        ),
        ("object at 0x7f3a2b1c9d40", "object at <addr>"),
        ("No such file or directory: '/data/shards/shard_0017.bin'", "No such file or directory: '<path>'"),
        ("cannot open C:\\Users\\me\\data\\x.bin now", "cannot open <path> now"),
        ("Connection to 10.0.3.17:29500 refused", "Connection to <host> refused"),
        (
            "Read error [127.0.0.1]:47012: Connection reset by peer",
            "Read error <host>: Connection reset by peer",
        ),
        ("connect() to [::1]:29500 timed out", "connect() to <host> timed out"),
        (
            "timed out after 1800000ms while trying to connect to (node-17.cluster.local, 29500).",
            "timed out after <duration> while trying to connect to (<host>, <num>).",
        ),
        ("Socket Timeout: gpu-node-3:29500 unreachable", "Socket Timeout: <host> unreachable"),
        ("host      : gpu-node-07", "host : <host>"),
        ("[Rank 3] failed: rank 3 exited (pid 12345)", "[Rank <num>] failed: rank <num> exited (pid <num>)"),
        ("[rank3]: failed at 2024-06-01 12:00:03.123", "[rank<num>]: failed at <time>"),
        ("time      : 2026-11-29_08:30:25", "time : <time>"),
        ("Timed out after 0:30:00", "Timed out after <time>"),
        ("run 550e8400-e29b-41d4-a716-446655440000 job a3f9c2d81b7e", "run <id> job <id>"),
        ("ran for 600012 milliseconds before timing out", "ran for <duration> before timing out"),
        ("Timed out waiting 2000ms for recv operation", "Timed out waiting <duration> for recv operation"),
        (
            "WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1048576, Timeout(ms)=600000)",
            "WorkNCCL(SeqNum=<num>, OpType=ALLREDUCE, NumelIn=<num>, Timeout(ms)=<num>)",
        ),
        (
            "Function 'MulBackward0' returned nan values in its 0th output.",
            "Function 'MulBackward0' returned nan values in its <num>th output.",
        ),
        ("could not convert string to float: 'abc def'", "could not convert string to float: '<str>'"),
        ("Missing key(s) in state_dict: 'fc.weight'", "Missing key(s) in state_dict: 'fc.weight'"),
        ("unexpected key 'layer.17.weight' in bucket", "unexpected key 'layer.<num>.weight' in bucket"),
        (
            "see https://pytorch.org/docs/stable/notes/cuda.html#environment-variables",
            "see https://pytorch.org/docs/stable/notes/cuda.html#environment-variables",
        ),
        (
            "at ../torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:123",
            "at ../torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:<num>",
        ),
        (
            "Tensor on device cuda:0 is not on the expected device cuda:1!",
            "Tensor on device cuda:<num> is not on the expected device cuda:<num>!",
        ),
        ("  lots   of\tspace  \n\n\n next line  ", "lots of space\nnext line"),
        ("lr -1.5e-06 and +3, dtype float32 fp16", "lr <num> and <num>, dtype float32 fp16"),
    ],
)
def test_normalize_message(message: str, template: str) -> None:
    assert normalize_message(message) == template


def test_normalize_message_is_idempotent_and_keeps_words() -> None:
    message = (
        "[PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with exception: "
        "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=781, OpType=BROADCAST, "
        "NumelIn=80, NumelOut=80, Timeout(ms)=600000) ran for 600087 milliseconds before timing out."
    )
    template = normalize_message(message)
    assert normalize_message(template) == template
    words = [w for w in re.findall(r"[A-Za-z_]{3,}", message) if w != "milliseconds"]  # "<duration>"
    assert words == re.findall(r"[A-Za-z_]{3,}", template.replace("<num>", "").replace("<duration>", ""))


def test_normalize_message_compacts_an_embedded_traceback() -> None:
    message = (
        "Caught ValueError in DataLoader worker process 1.\n"
        "Original Traceback (most recent call last):\n"
        f'  File "{SITE}/torch/utils/data/_utils/worker.py", line 374, in _worker_loop\n'
        "    data = fetcher.fetch(index)\n"
        "           ^^^^^^^^^^^^^^^^^^^^\n"
        '  File "/home/me/run-7/data.py", line 19, in __getitem__\n'
        "    raise ValueError(f'bad sample {i}')\n"
        "ValueError: bad sample 17\n"
    )
    assert normalize_message(message) == (
        "Caught ValueError in DataLoader worker process <num>.\n"
        "Original Traceback (most recent call last):\n"
        'File "data", in __getitem__\n'
        "ValueError: bad sample <num>"
    )


def test_normalize_message_is_bounded() -> None:
    template = normalize_message("x" * 10_000_000)
    assert len(template) == fp_module.MAX_TEMPLATE_CHARS


# ------------------------------------------------------------------------------------------------------
# Filenames


@pytest.mark.parametrize(
    ("filename", "module", "library"),
    [
        (f"{SITE}/torch/distributed/distributed_c10d.py", "torch.distributed.distributed_c10d", True),
        ("/usr/lib/python3/dist-packages/torch/nn/__init__.py", "torch.nn", True),
        ("/usr/lib/python3.11/multiprocessing/process.py", "multiprocessing.process", True),
        ("/root/.pyenv/versions/3.11.7/lib/python3.11/json/decoder.py", "json.decoder", True),
        ("<frozen runpy>", "runpy", True),
        ("/src/pytorch/torch/nn/functional.py", "torch.nn.functional", True),
        ("/opt/venv/bin/torchrun", "torchrun", True),
        ("C:\\Python311\\Lib\\site-packages\\torch\\nn\\modules\\linear.py", "torch.nn.modules.linear", True),
        ("C:\\Python311\\Lib\\json\\decoder.py", "json.decoder", True),
        ("/home/me/run-7/train.py", "train", False),
        ("/tmp/copy-b/train.py", "train", False),
        ("/home/me/proj/mypkg/__init__.py", "mypkg", False),
        ("train.py", "train", False),
        ("<string>", "<string>", False),
        ("<ipython-input-12-3f2a9c1b>", "<ipython-input>", False),
    ],
)
def test_module_and_library(filename: str, module: str, library: bool) -> None:
    assert module_from_filename(filename) == module
    assert is_library_path(filename) is library


def test_library_prefixes() -> None:
    assert is_library_path("/opt/company/libs/trainer/loop.py", ["/opt/company/libs"])
    assert module_from_filename("/opt/company/libs/trainer/loop.py", ["/opt/company/libs/"]) == "trainer.loop"
    assert not is_library_path("/opt/company/app/loop.py", ["/opt/company/libs"])


def test_stdlib() -> None:
    assert is_stdlib_path("/usr/lib/python3.11/threading.py")
    assert is_stdlib_path("<frozen importlib._bootstrap>")
    assert is_stdlib_path("/lib/x86_64-linux-gnu/libc.so.6")
    assert not is_stdlib_path(f"{SITE}/torch/_utils.py")
    assert not is_stdlib_path("/home/me/train.py")


# ------------------------------------------------------------------------------------------------------
# Frame selection and hints


def contributing(frames: List[FrameInfo]) -> List[str]:
    result = fingerprint("E", "m", frames)
    assert [h.frame_index for h in result.hints] == list(range(len(frames)))
    return [f"{frames[h.frame_index].function}" for h in result.hints if h.contributes]


def reasons(frames: List[FrameInfo]) -> List[str]:
    return [h.reason for h in fingerprint("E", "m", frames).hints]


def test_in_app_frames_preferred_and_innermost_library_frame_kept() -> None:
    frames = [
        std("_bootstrap"),
        app("main"),
        lib("_call_impl", "torch.nn.modules.module"),
        app("forward", "model"),
        lib("forward", "torch.nn.modules.sparse"),
        lib("embedding"),
    ]
    assert contributing(frames) == ["main", "forward", "embedding"]
    assert reasons(frames) == [
        "stdlib frame",
        "in-app frame",
        "library frame: in-app frames present",
        "in-app frame",
        "library frame: in-app frames present",
        "innermost library frame: raised the exception",
    ]


def test_innermost_in_app_frame_means_no_library_frame() -> None:
    frames = [app("main"), lib("wrapper", "torch.distributed.elastic.multiprocessing.errors"), app("step")]
    assert contributing(frames) == ["main", "step"]


def test_no_in_app_frames_library_frames_contribute_but_not_stdlib() -> None:
    frames = [std("run"), lib("_worker_loop", "torch.utils.data._utils.worker"), lib("fetch")]
    assert contributing(frames) == ["_worker_loop", "fetch"]
    assert reasons(frames)[0] == "stdlib frame"
    assert reasons(frames)[1] == "library frame: no in-app frames"


def test_only_stdlib_frames_contribute_when_nothing_else() -> None:
    frames = [std("run"), std("decode", "json.decoder")]
    assert contributing(frames) == ["run", "decode"]
    assert set(reasons(frames)) == {"stdlib frame: no other frames"}


def test_no_frames_at_all() -> None:
    result = fingerprint("Fatal Python error", "Aborted", [])
    assert result.hints == ()
    assert len(result.hash) == 32


def test_direct_recursion_collapses_independent_of_depth() -> None:
    shallow = [app("main")] + [app("descend", lineno=9)] * 3 + [app("leaf")]
    deep = [app("main")] + [app("descend", lineno=9)] * 997 + [app("leaf")]
    assert contributing(shallow) == ["main", "descend", "leaf"]
    assert fingerprint("E", "m", shallow).hash == fingerprint("E", "m", deep).hash
    assert reasons(shallow)[2:4] == ["duplicate recursion frame"] * 2


def test_mutual_recursion_collapses() -> None:
    def chain(depth: int) -> List[FrameInfo]:
        return [app("main")] + [app("even"), app("odd")] * depth + [app("leaf")]

    assert contributing(chain(2)) == ["main", "even", "odd", "leaf"]
    assert fingerprint("E", "m", chain(2)).hash == fingerprint("E", "m", chain(400)).hash


def test_only_the_innermost_frames_contribute() -> None:
    frames = [app(f"f{i}") for i in range(MAX_FRAMES + 5)]
    assert contributing(frames) == [f"f{i}" for i in range(5, MAX_FRAMES + 5)]
    assert reasons(frames)[:5] == ["beyond frame limit"] * 5
    outer_changed = [app("other_entry"), *frames[1:]]
    assert fingerprint("E", "m", outer_changed).hash == fingerprint("E", "m", frames).hash


def test_hash_is_sha256_of_the_versioned_canonical_input() -> None:
    frames = [app("main"), app("step"), lib("all_reduce", "torch.distributed.distributed_c10d")]
    result = fingerprint("RuntimeError", "Timed out waiting 2000ms", frames)
    text = canonical_input("RuntimeError", result.message_template, frames)
    assert text.splitlines()[0] == FINGERPRINT_VERSION == result.version == "fp:v1"
    assert text == (
        "fp:v1\ntype:RuntimeError\nframe:train:main\nframe:train:step\n"
        "frame:torch.distributed.distributed_c10d:all_reduce\nmessage:Timed out waiting <duration>"
    )
    assert result.hash == hashlib.sha256(text.encode()).hexdigest()[:32]


def test_line_numbers_paths_and_context_lines_do_not_matter() -> None:
    one = [
        FrameInfo("/a/train.py", "train", "main", 10, True, "main()"),
        FrameInfo("/a/train.py", "train", "step", 20, True, "x @ w"),
    ]
    two = [
        FrameInfo("/b/c/train.py", "train", "main", 99, True, ""),
        FrameInfo("/b/c/train.py", "train", "step", 7, True, "y @ v"),
    ]
    assert (
        fingerprint("E", "shape (4x8 and 16x2)", one).hash
        == fingerprint("E", "shape (2x3 and 5x1)", two).hash
    )


def test_type_site_and_message_words_each_change_the_hash() -> None:
    frames = [app("main"), app("step")]
    base = fingerprint("RuntimeError", "Timed out waiting 2000ms for recv", frames).hash
    assert fingerprint("ValueError", "Timed out waiting 2000ms for recv", frames).hash != base
    assert fingerprint("RuntimeError", "Timed out waiting 2000ms for send", frames).hash != base
    assert (
        fingerprint("RuntimeError", "Timed out waiting 2000ms for recv", [app("main"), app("eval")]).hash
        != base
    )
    via_broadcast = [*frames, lib("broadcast", "torch.distributed.distributed_c10d")]
    via_all_reduce = [*frames, lib("all_reduce", "torch.distributed.distributed_c10d")]
    assert fingerprint("E", "m", via_broadcast).hash != fingerprint("E", "m", via_all_reduce).hash


def test_to_dict_matches_the_proto_field_names() -> None:
    proto = (REPO / "proto" / "trainguard" / "v1" / "events.proto").read_text()

    def fields(message: str) -> set:
        body = re.search(r"message " + message + r" \{(.*?)\n\}", proto, re.S)
        assert body, message
        return set(re.findall(r"^\s+(?:repeated\s+)?[\w.]+\s+(\w+)\s*=", body.group(1), re.M))

    result = fingerprint("E", "m", [app("main")]).to_dict()
    assert set(result) <= fields("ExceptionEvent")
    assert set(result["hints"][0]) == fields("FingerprintHint")
    json.dumps(result)


def test_exception_type_names() -> None:
    class Local(Exception):
        pass

    assert exception_type_name(ValueError) == "ValueError"
    assert exception_type_name(Local).endswith(".test_exception_type_names.<locals>.Local")
    assert exception_type_name(json.JSONDecodeError) == "json.decoder.JSONDecodeError"


# ------------------------------------------------------------------------------------------------------
# A live exception and its printed text have one fingerprint


def _recurse(n: int) -> int:
    return _recurse(n + 1)


def _even(n: int) -> int:
    if n > 50:
        raise ValueError(f"depth {n} reached at 0x{id(n):x}")
    return _odd(n + 1)


def _odd(n: int) -> int:
    return _even(n + 1)


def _chained() -> None:
    try:
        {"a": 1}["missing-key-7"]
    except KeyError as exc:
        raise RuntimeError("lookup failed for rank 3") from exc


def _context() -> None:
    try:
        int("not a number")
    except ValueError:
        [][5]


def _multiline() -> None:
    raise RuntimeError(
        "Error(s) in loading state_dict for Linear:\n\tsize mismatch for weight: "
        "torch.Size([4, 16]) vs torch.Size([4, 8]).\n\n  trailing detail  "
    )


def _embedded() -> None:
    try:
        _even(0)
    except ValueError:
        text = traceback.format_exc()
    raise ValueError("Caught ValueError in DataLoader worker process 0.\nOriginal " + text)


def _noted() -> None:
    exc = OSError(28, "No space left on device", "/data/ckpt/step_100.pt")
    if hasattr(exc, "add_note"):
        exc.add_note("while saving checkpoint 100")
    raise exc


def _empty_message() -> None:
    raise KeyboardInterrupt


def _json_error() -> None:
    json.loads("{oops")


def _syntax_error() -> None:
    compile("weights = (1,\n", "<generated config>", "exec")


LIVE_CASES: List[Callable[[], object]] = [
    lambda: _recurse(0),
    lambda: _even(0),
    _chained,
    _context,
    _multiline,
    _embedded,
    _noted,
    _empty_message,
    _json_error,
    _syntax_error,
]


@pytest.mark.parametrize("raiser", LIVE_CASES, ids=lambda f: getattr(f, "__name__", "case"))
@pytest.mark.parametrize("prefix", ["", "[rank3]: ", "[default0]:"])
def test_live_exception_and_printed_text_agree(raiser: Callable[[], object], prefix: str) -> None:
    try:
        raiser()
    except BaseException as exc:
        live = fingerprint_exception(exc)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    printed = "".join(prefix + line + "\n" for line in text.splitlines())
    parsed = fingerprint_text(printed)
    assert parsed is not None
    assert (parsed.exc_type, parsed.message_template, parsed.hash) == (
        live.exc_type,
        live.message_template,
        live.hash,
    )


def test_live_and_text_agree_with_torch() -> None:
    torch = pytest.importorskip("torch")
    raisers = [
        lambda: torch.nn.Embedding(10, 4)(torch.tensor([1, 12])),
        lambda: torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(2, 2))(torch.randn(3, 8)),
        lambda: torch.zeros(4) @ torch.zeros(8),
    ]
    for raiser in raisers:
        try:
            raiser()
        except Exception as exc:
            live = fingerprint_exception(exc)
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        parsed = fingerprint_text(text)
        assert parsed is not None and parsed.hash == live.hash


CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from trainguard.core.fingerprint import fingerprint_exception

def hook(exc_type, exc, tb):
    with open(sys.argv[2], "w") as out:
        json.dump(fingerprint_exception(exc).to_dict(), out)
    sys.__excepthook__(exc_type, exc, tb)

sys.excepthook = hook


class CheckpointError(Exception):
    pass


def descend(n):
    return descend(n + 1) if n < 5000 else None


def load(path):
    try:
        descend(0)
    except RecursionError as exc:
        raise CheckpointError(f"cannot load {path} on rank 2 (pid 4242)") from exc


load("/data/run-17/ckpt_0003.pt")
"""


def test_default_excepthook_output_matches_live_fingerprint(tmp_path: Path) -> None:
    """The real interpreter's stderr for an uncaught chained exception, parsed, equals the live hash."""
    script = tmp_path / "job.py"
    script.write_text(CHILD)
    result_file = tmp_path / "live.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO / "sdk" / "src"), str(result_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 1, proc.stderr
    assert "[Previous line repeated" in proc.stderr
    live = json.loads(result_file.read_text())
    parsed = fingerprint_text(proc.stderr)
    assert parsed is not None
    assert parsed.to_dict()["fingerprint"] == live["fingerprint"]
    assert (
        parsed.message_template == live["message_template"] == "cannot load <path> on rank <num> (pid <num>)"
    )


def test_frames_from_traceback_context_only_on_request() -> None:
    try:
        _chained()
    except RuntimeError as exc:
        tb = exc.__traceback__
    frames = frames_from_traceback(tb)
    assert [f.function for f in frames] == ["test_frames_from_traceback_context_only_on_request", "_chained"]
    assert all(f.context_line == "" and f.lineno > 0 and f.in_app for f in frames)
    with_source = frames_from_traceback(tb, with_context=True)
    assert with_source[-1].context_line.startswith("raise RuntimeError")
    assert frames_from_traceback(None) == []


# ------------------------------------------------------------------------------------------------------
# Contracts of the module itself


@pytest.mark.parametrize("name", ["fingerprint.py", "tracebacks.py"])
def test_pure_and_python39_syntax(name: str) -> None:
    path = REPO / "sdk" / "src" / "trainguard" / "core" / name
    tree = ast.parse(path.read_text(), feature_version=(3, 9))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    allowed = {
        "__future__",
        "hashlib",
        "re",
        "types",
        "dataclasses",
        "typing",
        "linecache",
        "trainguard.core.fingerprint",
    }
    assert imported <= allowed, imported - allowed
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert "linecache" not in {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    assert isinstance(tree.body[1], ast.ImportFrom) and tree.body[1].module == "__future__"


def test_fingerprint_versions_are_registered_and_never_replaced() -> None:
    from trainguard.core import fingerprint as fp_module

    frames = [FrameInfo(filename="/home/u/train.py", module="train", function="step", lineno=3, in_app=True)]
    assert sorted(fp_module.FINGERPRINTERS) == ["fp:v1"] and FINGERPRINT_VERSION in fp_module.FINGERPRINTERS
    v1 = fingerprint("ValueError", "bad 12", frames)
    assert fingerprint("ValueError", "bad 12", frames, version="fp:v1") == v1 and v1.version == "fp:v1"
    with pytest.raises(ValueError, match="unknown fingerprint version 'fp:v9'; known: fp:v1"):
        fingerprint("ValueError", "bad 12", frames, version="fp:v9")
    with pytest.raises(ValueError, match="registered already"):
        fp_module.register_fingerprinter("fp:v1", lambda t, m, f: v1)
    with pytest.raises(ValueError, match="'fp:v<N>'"):
        fp_module.register_fingerprinter("v2", lambda t, m, f: v1)
    fp_module.register_fingerprinter("fp:v2", lambda t, m, f: fp_module.Fingerprint(
        "fp:v2", "0" * 32, t, m, ()))
    try:
        assert fingerprint("ValueError", "bad 12", frames, version="fp:v2").version == "fp:v2"
        assert fingerprint("ValueError", "bad 12", frames) == v1  # the default is unchanged
    finally:
        del fp_module.FINGERPRINTERS["fp:v2"]
