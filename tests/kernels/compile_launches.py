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
    # Longest first, one job at a time: the tl.dot kernels take 1-6 s of CPU each (an fp32 IEEE dot, FMA code, up to
    # 6 s), the rest 0.1-0.2 s (2-core Zen 5, 2026-11-27: 79 CPU-seconds for 159 jobs). In launch order, chunks of 4
    # left one worker compiling the fp32 dots while the other sat idle.
    order = sorted(range(len(jobs)), key=lambda i: _cost(jobs[i]), reverse=True)
    results = [None] * len(jobs)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for i, result in zip(order, pool.map(compile_launch, [jobs[i] for i in order])):
            results[i] = result
    json.dump(results, sys.stdout)


def _cost(launch: dict) -> int:
    """A rough rank of a launch's compile time: kernels with tl.dot (attention most), fp32 IEEE dots highest."""
    dot = "attention" in launch["kernel"] and "preprocess" not in launch["kernel"] or launch["kernel"] == "_matmul_kernel"
    ieee_fp32 = launch["constexprs"].get("DOT_PRECISION") == "ieee" and "*fp32" in launch["signature"].values()
    return 4 * dot + 2 * (dot and ieee_fp32) + ("bwd" in launch["kernel"])


if __name__ == "__main__":
    main(sys.argv[1:])
