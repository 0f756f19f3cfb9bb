"""How the `kiln` process ends: everything flushed, then the process exits without tearing its objects down.

    freeze_loaded()      the objects alive now (torch's and kiln's modules) out of the garbage collector's scans
    exit_process(code)   flush, run the atexit handlers, os._exit(code); a normal sys.exit where that could lose
                         anything (a thread still running, a torch.distributed process group still up)

By the time a subcommand returns, its work is written: the checkpoint is sealed, metrics.jsonl and TensorBoard's
writer are closed. What Python does after that is tear the interpreter down: a last full garbage collection over
every object of the process and the deallocation of its ~2,000 modules, which a training process pays once more
than a plain loop does (~320k objects against ~200k). On the 2-core Xeon (AMX, one thread, 2026-11-27) it took
0.95 s of CPU after `kiln train`, 0.55 s after `import torch, numpy`; gc.freeze() alone cut the collection but then
nanobind's modules (triton's) reported leaks at exit. Ending with os._exit skips the teardown whole, so nothing
reports and nothing is collected (and freeze_loaded's frozen objects cost nothing at exit); what a normal exit would still have done for the user's data is done here first:
the atexit handlers (logging, multiprocessing's workers, temporary directories), every open Python file flushed,
the C library's stdio buffers flushed (oneDNN's verbose lines, a C++ library's std::cout), and CUDA's queue drained.
"""
from __future__ import annotations

import _io
import atexit
import ctypes
import gc
import os
import sys
import threading


def freeze_loaded() -> None:
    """gc.freeze(): the ~300k objects of the modules loaded so far (functions, classes, constants: they live as long
    as the process) are never scanned again. Python's full collections all fall in a run's set-up, while the
    imports and torch._dynamo's (a torch optimizer's first call) grow the heap; in a 21-update `kiln train` on the
    2-core Xeon (AMX, one thread, 2026-11-27) its 6 full collections took 0.67 s of CPU (a plain loop's 5: 0.47 s),
    the last three 0.49 s, each scanning every object loaded before it. For the `kiln` command only: a frozen object
    is never freed, which a long-lived Python process calling kiln.fit must not be made to pay."""
    gc.freeze()


# Python's own exit status when flushing stdout fails at exit (e.g. its reader went away)
FLUSH_FAILED = 120


def fast_exit_safe() -> bool:
    """Whether nothing but the teardown is left: no other thread that a normal exit would wait for (a non-daemon
    thread is still doing work), no torch.distributed process group (its collectives end with destroy)."""
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


def _flush_open_files() -> None:
    """Flush every Python file object still open (a normal exit's finalizers would have; os._exit does not)."""
    # By the type's own bases: every file object of io, C or Python (gzip's too), derives from _io._IOBase. Not
    # isinstance(obj, io.IOBase): it reads obj.__class__, which some objects warn on, and the ABC's subclass check
    # took 0.26 s for the ~900 types of a training process's ~300k objects; this scan takes ~0.05 s.
    is_file: dict[type, bool] = {}
    for obj in gc.get_objects():
        kind = type(obj)
        known = is_file.get(kind)
        if known is None:
            known = is_file[kind] = _io._IOBase in kind.__mro__
        if known:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):  # a pipe whose reader left, a file closed meanwhile: as a normal exit
                pass


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)  # fflush(NULL): every C stdio stream of the process
    except (OSError, AttributeError):  # no C library to load by that name (not glibc/musl/macOS)
        pass


def exit_process(code: int) -> None:
    """End the process with `code`: flushed and without the interpreter's teardown where fast_exit_safe, else
    sys.exit(code)."""
    if not fast_exit_safe():
        gc.unfreeze()  # a normal teardown, as without freeze_loaded (frozen objects at exit: nanobind reports leaks)
        sys.exit(code)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    atexit._run_exitfuncs()  # what Py_Finalize runs before the teardown, in the same order
    gc.disable()  # nothing is collected from here on: the process ends
    gc.unfreeze()  # gc.get_objects() lists no frozen object, and a file opened before freeze_loaded may be one
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = code or FLUSH_FAILED
    _flush_c_stdio()
    os._exit(code)
