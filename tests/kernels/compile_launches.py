"""Compile recorded kernel launches for GPU targets with Triton's compiler and ptxas; no GPU needed.

    python -m tests.kernels.compile_launches JOBS.json

JOBS.json is a list of {"arch", "module", "kernel", "signature", "constexprs", "options"}: launches as recorded by
tests/kernels/test_kernels_gpu_launches.py and the compute capability to compile each for (80, 89, 90, ...). Prints a
JSON list with, per job, the shared memory the compiled kernel needs and the size of its cubin, or the compiler's
error. Must run without TRITON_INTERPRET, so that the kernels are defined for the compiler.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor


def compile_launch(launch: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    arch = launch["arch"]
    result = {"kernel": launch["kernel"], "arch": arch, "signature": launch["signature"],
              "constexprs": launch["constexprs"], "options": launch["options"]}
    try:
        compiled = triton.compile(ASTSource(kernel, launch["signature"], launch["constexprs"]),
                                  target=GPUTarget("cuda", arch, 32), options=launch["options"])
    except Exception as error:  # noqa: BLE001 - every compiler failure is a result to report
        return {**result, "error": f"{type(error).__name__}: {error}"}
    return {**result, "shared": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"])}


def main(argv: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("compile_launches: unset TRITON_INTERPRET (the kernels must be defined for the compiler)")
    with open(argv[0]) as f:
        jobs = json.load(f)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_launch, jobs, chunksize=4))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
