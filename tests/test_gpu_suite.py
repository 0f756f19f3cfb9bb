"""benchmarks/gpu_suite.py --dry-run: every part runs its real code path on CPU at toy sizes and writes its JSON.

The GPU run gets one ~25 min window on a fresh machine; a part that crashes there costs the window, so the dry run
is what catches it here. Numbers are checked for being measured (finite, positive, errors derived from the
predicted and measured values in the same file), not for their size.
"""
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The dry run takes 14-109 s on 2 CPU cores: `make gpu-preflight` runs this file before a GPU window, `make test`
# leaves it out (docs/testing.md).
pytestmark = pytest.mark.gpu_preflight


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-results")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def load(out: Path, part: str) -> dict:
    data = json.loads((out / f"{part}.json").read_text())
    assert (out / f"{part}.md").read_text().startswith(f"# {part}")
    assert data["part"] == part and data["dry_run"] is True and "error" not in data
    assert set(data["env"]) >= {"gpu", "driver", "cuda", "torch", "triton", "date"}
    return data


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_summary_all_done(results):
    summary = json.loads((results / "summary.json").read_text())
    assert summary["parts"] == {p: "done" for p in ("tests", "throughput", "memory", "kernels", "profile", "fp8")}


def test_tests_part_reads_junit(results):
    data = load(results, "tests")
    assert "SKIPPED" in (results / "tests.log").read_text()  # pytest -v's per-test lines, kept whole
    assert data["returncode"] == 0 and not data["timed_out"]
    # tests/memory/test_levers.py -m gpu: its CUDA test is collected and skipped on CPU.
    assert data["tests"] >= 1 and data["skipped"] == data["tests"] and data["failed"] == 0 and data["failures"] == []
    assert (results / data["junit"]).exists()


def test_throughput_part_measures_both_loops(results):
    data = load(results, "throughput")
    loops = data["loops"]
    for name in ("plain", "kiln"):
        assert finite_positive(loops[name]["tokens_per_s"]) and finite_positive(loops[name]["mfu"])
        assert loops[name]["mfu"] < 1  # against the measured matmul rate; ≥ 1 means a wrong FLOP count or timer
    assert finite_positive(data["ratio_kiln_over_plain"])
    ratio = loops["kiln"]["tokens_per_s"] / loops["plain"]["tokens_per_s"]
    assert data["ratio_kiln_over_plain"] == pytest.approx(ratio)
    assert finite_positive(data["matmul"]["flops_per_s"]) and finite_positive(data["flops_per_token"])
    assert data["data"] and data["compile"] is True  # the comparison: both loops under torch.compile
    assert data["variants_compile"] is False  # the dry run times the variants eager (their inductor builds cost ~100 s)
    variants = data["variants"]
    assert variants["kiln triton kernels"] == {"skipped": "Triton kernels need CUDA"}
    measured = {k: v for k, v in variants.items() if "triton" not in k}
    assert len(measured) == 3
    for name, v in measured.items():
        assert "error" not in v, (name, v)
        assert finite_positive(v["tokens_per_s"]), (name, v)
    assert max(v["batch"] for v in measured.values()) == 2 * loops["kiln"]["batch"]


def test_memory_part_compares_estimate_with_measurement(results):
    data = load(results, "memory")
    points = data["points"]
    assert [(p["precision"], p["recompute"]) for p in points] == [("fp32", "none"), ("fp32", "full")]
    for p in points:
        assert finite_positive(p["predicted_bytes"]) and finite_positive(p["measured_bytes"])
        assert p["rel_error"] == pytest.approx((p["predicted_bytes"] - p["measured_bytes"]) / p["measured_bytes"])
    # Full recompute keeps fewer activations: a measurement that ignores the lever would not see that.
    assert points[1]["measured_bytes"] < points[0]["measured_bytes"]
    assert data["max_abs_rel_error"] == pytest.approx(max(abs(p["rel_error"]) for p in points))


def test_memory_part_numbers_match_an_independent_measurement(results):
    # The same toy point measured here: the suite must report what measure_step and the estimator give, not a
    # number made up from the other one.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from gpu_suite import TOY

    from kiln.config import load_config
    from kiln.memory.devices import local_device
    from kiln.memory.estimate import estimate, peak_allocated
    from kiln.memory.levers import JobSections, job_for
    from kiln.run.measure import measure_step

    point = load(results, "memory")["points"][0]
    cfg = load_config(None, [f"--model.n_layer={TOY['n_layer']}", f"--model.n_head={TOY['n_head']}",
                             f"--model.d_model={TOY['d_model']}", f"--data.seq_len={TOY['seq_len']}",
                             f"--train.micro_batch_size={TOY['batch']}", "--train.device=cpu",
                             "--precision.mode=fp32", "--memory.recompute=none"])
    cpu = torch.device("cpu")
    assert point["predicted_bytes"] == peak_allocated(estimate(job_for(JobSections.of(cfg), local_device(cpu))))
    # CPU peaks are live-tensor byte counts (kiln/memory/measure.py), deterministic for a fixed seed and shape.
    assert point["measured_bytes"] == measure_step(cfg, cpu, steps=3).step_peaks[-1]


def test_fp8_part_runs_bf16_and_records_why_fp8_cannot_run_here(results):
    """On CPU the dry run trains bf16 at the toy shape and records fp8's refusal (no fp8 tensor cores) as that
    mode's error: the part's code paths run, and a GPU run fills the same rows with numbers."""
    data = load(results, "fp8")
    bf16, fp8 = data["modes"]["bf16"], data["modes"]["fp8"]
    assert finite_positive(bf16["tokens_per_s"]) and math.isfinite(bf16["final_loss"]) and bf16["final_step"] == 4
    assert "compute capability ≥ 8.9" in fp8["error"]
    assert "| fp8 | KilnError: precision.mode='fp8' needs" in (results / "fp8.md").read_text()


def test_profile_part_holds_the_breakdown_and_verdict(results):
    summary = load(results, "profile")["summary"]
    assert summary["verdict"] in ("data-bound", "communication-bound", "host-overhead-bound", "compute-bound",
                                  "memory-bandwidth-bound")
    assert abs(sum(summary["breakdown"].values()) - summary["step_s"]) < 1e-9 * summary["step_s"] + 1e-12


def test_kernels_part_captures_output(results):
    data = load(results, "kernels")
    # Without CUDA benchmarks/kernels.py exits 1 with its own message; the suite records it rather than failing.
    assert data["returncode"] == 1 and not data["timed_out"]
    assert "needs a CUDA GPU" in data["output"]


def test_gpu_configs_resolve_to_the_shapes_they_name():
    # The GPU paths cannot run here; their configs can. The throughput part must build GPT-2 124M (biases, seq 1024,
    # as the plain model has), at any batch, and every memory grid point must load.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from gpu_suite import GPT2, GRID_MODELS, kiln_overrides

    from kiln.config import load_config

    for batch in (GPT2["batch"], 2 * GPT2["batch"]):
        cfg = load_config(None, kiln_overrides(dict(GPT2, batch=batch), 50257, torch.device("cuda"), []))
        model = cfg.model.resolve()
        assert (model.n_layer, model.n_head, model.d_model, model.vocab_size) == (12, 12, 768, 50257)
        assert model.bias and model.max_seq_len >= cfg.data.seq_len == 1024
        assert cfg.train.micro_batch_size == batch and cfg.train.device == "cuda"
    for name, args in GRID_MODELS.items():
        for precision in ("fp32", "bf16", "bf16-master"):
            for recompute in ("none", "full", "selective"):
                load_config(None, args + ["--data.tokenizer=bpe", "--data.vocab_size=50257", "--train.device=cuda",
                                          f"--precision.mode={precision}", f"--memory.recompute={recompute}"])


def test_a_cut_off_pytest_run_is_counted_from_its_verbose_lines():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_suite import verbose_summary

    out = ("============================= test session starts ==============================\n"
           "tests/a.py::test_x PASSED                                                [  1%]\n"
           "tests/a.py::test_y[cuda-bf16] FAILED                                     [  2%]\n"
           "tests/b.py::test_z SKIPPED (needs CUDA)                                  [  3%]\n"
           "tests/b.py::test_w ERROR                                                 [  4%]\n"
           "tests/c.py::test_v XFAIL (known)                                         [  5%]\n"
           "tests/c.py::test_u ")  # the line pytest was writing when it was killed
    counts, failures = verbose_summary(out)
    assert counts == dict(tests=5, passed=1, failed=1, errors=1, skipped=2)
    assert failures == ["tests/a.py::test_y[cuda-bf16]", "tests/b.py::test_w"]


# ---------------------------------------------------------------- merge into docs/benchmarks.md
BEGIN, END = "<!-- gpu-suite:begin -->", "<!-- gpu-suite:end -->"
# CRLF lines and trailing spaces on both sides: the text outside the markers must come back byte for byte.
SAMPLE_DOC = ("# Benchmarks\r\n\r\nA CRLF paragraph with trailing spaces   \r\n\n"
              "## GPU suite (`benchmarks/gpu_suite.py`)\n\nHow to run it.\n\n"
              f"{BEGIN}\nNot yet measured on a GPU.\n{END}\n\n"
              "## Kernels\n\n| op | shape |\n|---|---|\n| all | not yet measured |  \r\n\r\n")


def gpu_suite():
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite
    return gpu_suite


def merge_into(doc: Path, results: Path, *extra: str) -> int:
    return gpu_suite().main(["merge", str(results), "--doc", str(doc), *extra])


def merged(tmp_path: Path, results: Path, text: str = SAMPLE_DOC, *extra: str) -> str:
    doc = tmp_path / "benchmarks.md"
    doc.write_bytes(text.encode())
    assert merge_into(doc, results, "--allow-dry-run", *extra) == 0
    return doc.read_bytes().decode()


def between(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def table(body: str, title: str) -> list[list[str]]:
    """The data rows of the table under the `### {title}...` heading, as cell strings."""
    lines = body[body.index(f"### {title}"):].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return rows


def as_gpu_run(src: Path, dst: Path) -> dict:
    """A copy of the dry run's results that says it came from an H100, for the paths a CPU cannot produce."""
    shutil.copytree(src, dst)
    parts = {}
    for part in ("tests", "throughput", "memory", "kernels", "profile", "fp8"):
        data = json.loads((dst / f"{part}.json").read_text())
        data["dry_run"] = False
        data["env"].update(device="cuda", gpu="NVIDIA H100 80GB HBM3", driver="550.54.15", cuda="12.4")
        parts[part] = data
    return parts


def save(dst: Path, parts: dict) -> None:
    for part, data in parts.items():
        (dst / f"{part}.json").write_text(json.dumps(data))


def test_merge_tables_hold_the_json_numbers(results, tmp_path):
    body = between(merged(tmp_path, results))
    tests, tp, mem = load(results, "tests"), load(results, "throughput"), load(results, "memory")
    assert body.count("### ") == 6
    assert body.count(f"torch {tests['env']['torch']}, triton {tests['env']['triton']}, **DRY RUN") == 6

    assert table(body, "GPU tests") == [[str(tests[k]) for k in ("tests", "passed", "failed", "errors", "skipped")]
                                        + [f"{tests['seconds']:.0f}"]]

    rows = {r[0]: r for r in table(body, "Throughput")}
    plain_tps = tp["loops"]["plain"]["tokens_per_s"]
    for name in ("plain", "kiln"):
        r = tp["loops"][name]
        assert rows[name] == [name, str(r["batch"]), f"{r['tokens_per_s']:,.0f}",
                              f"{r['tokens_per_s'] / plain_tps:.3f}×", f"{r['mfu']:.2%}", "n/a (CPU)", "n/a (CPU)"]
    assert rows["kiln triton kernels"][1] == "not run (Triton kernels need CUDA)"
    assert len(rows) == 2 + len(tp["variants_planned"])
    ratio, mfu = tp["ratio_kiln_over_plain"], tp["loops"]["kiln"]["mfu"]
    assert (f"- kiln ≥ 1.3× the plain loop's tokens/s: {'**reached**' if ratio >= 1.3 else '**not reached**'} "
            f"({ratio:.3f}×)") in body
    assert f"- kiln MFU ≥ 50% of the measured matmul rate: **not reached** ({mfu:.2%})" in body  # toy: ~5%
    assert ("- peak ≤ 0.5× the plain loop's with chunked loss + selective recompute, equal batch: "
            "not measured") in body  # no CUDA peak on CPU

    rows = table(body, "Memory")
    assert [r[:3] for r in rows] == [[p["model"], p["precision"], p["recompute"]] for p in mem["points"]]
    for p, r in zip(mem["points"], rows):
        assert float(r[3]) == pytest.approx(p["predicted_bytes"] / 2**20, abs=5e-4)
        assert float(r[4]) == pytest.approx(p["measured_bytes"] / 2**20, abs=5e-4)
        assert r[5] == f"{p['rel_error']:+.2%}"
    assert f"**reached** (max |error| {mem['max_abs_rel_error']:.2%} at toy fp32" in body  # toy errors < 1%

    rows = table(body, "Profile")
    profile = load(results, "profile")["summary"]
    assert [r[0] for r in rows] == [*profile["breakdown"], "step"] and f"**{profile['verdict']}**" in body

    fp8 = load(results, "fp8")["modes"]
    rows = {r[0]: r for r in table(body, "fp8")}
    assert rows["bf16"][4] == f"{fp8['bf16']['final_loss']:.4f} (step 4)" and rows["bf16"][2] == "1.000×"
    assert rows["fp8"][1].startswith("not run: KilnError: precision.mode='fp8' needs")

    (row,) = table(body, "Kernels")
    assert row[0].startswith("failed (exit 1): benchmarks/kernels.py needs a CUDA GPU")


def test_merge_keeps_the_rest_of_the_file_and_is_idempotent(results, tmp_path):
    text = merged(tmp_path, results)
    b, e = SAMPLE_DOC.index(BEGIN) + len(BEGIN), SAMPLE_DOC.index(END)
    assert text[:b] == SAMPLE_DOC[:b] and text.endswith(SAMPLE_DOC[e:])
    assert "Not yet measured" not in between(text) and "| plain |" in between(text)
    doc = tmp_path / "benchmarks.md"
    assert merge_into(doc, results, "--allow-dry-run") == 0
    assert doc.read_bytes().decode() == text


def test_merge_refuses_dry_run_results(results, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_bytes(SAMPLE_DOC.encode())
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "merge", str(results), "--doc", str(doc)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and "dry run" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert doc.read_bytes() == SAMPLE_DOC.encode()


def test_missing_part_is_a_not_run_row(results, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(results, partial)
    (partial / "memory.json").unlink()
    body = between(merged(tmp_path, partial))
    assert table(body, "Memory") == [["not run (no memory.json)", "", "", "", "", ""]]
    assert "- estimator within 3% of the measured peak on every grid point: not measured" in body
    assert table(body, "GPU tests")[0][0] == str(load(results, "tests")["tests"])  # the others still render
    assert "did not finish" not in body  # summary.json is there: the run ended


def test_gpu_results_merge_without_flag_and_cut_off_parts_are_rows(results, tmp_path):
    run = tmp_path / "run"
    parts = as_gpu_run(results, run)
    (run / "summary.json").unlink()  # the window closed before the suite's end
    parts["tests"].update(timed_out=True, returncode=None, seconds=420.3, junit=None,
                          tests=0, passed=0, failed=0, errors=0, skipped=0)
    tp = parts["throughput"]
    tp["loops"]["plain"]["peak_bytes"], tp["loops"]["kiln"]["peak_bytes"] = 1000 * 2**20, 800 * 2**20
    lean = tp["variants"]["kiln chunked+selective"]
    lean.update(peak_bytes=400 * 2**20, peak_vs_plain=0.4)
    tp["variants"]["kiln chunked_loss=128"] = {"skipped": "time box spent"}
    del tp["variants"]["kiln chunked+selective 2x batch"]
    mem = parts["memory"]
    mem["points"][0]["rel_error"] = 0.05
    cut = mem["points"].pop()
    parts["kernels"].update(timed_out=True, returncode=None, seconds=240.0,
                            output="device-to-device copy: 2900 GB/s\n| rms_norm | 4096x768 | 0.05 | 0.20 | 0.10 "
                                   "| 4.00x | 6 | 30 | 12 | 81% of copy bandwidth |\n")
    save(run, parts)

    doc = tmp_path / "benchmarks.md"
    doc.write_bytes(SAMPLE_DOC.encode())
    assert merge_into(doc, run) == 0  # no --allow-dry-run: these say CUDA
    body = between(doc.read_bytes().decode())
    assert "DRY RUN" not in body and body.count("NVIDIA H100 80GB HBM3, driver 550.54.15, CUDA 12.4,") == 6
    assert "**The run did not finish**" in body
    assert table(body, "GPU tests") == [["cut off by its time box after 420 s (pytest killed; counted from its -v lines)"]
                                        + [""] * 5]
    rows = {r[0]: r for r in table(body, "Throughput")}
    assert rows["kiln"][5:] == ["800", "0.800×"] and rows["kiln chunked+selective"][5:] == ["400", "0.400×"]
    assert rows["kiln chunked_loss=128"][1] == "not run (time box spent)"
    assert rows["kiln chunked+selective 2x batch"][1] == "not run (the suite stopped before it)"
    assert ("- peak ≤ 0.5× the plain loop's with chunked loss + selective recompute, equal batch: **reached** "
            "(0.400×)") in body
    rows = table(body, "Memory")
    assert rows[0][5] == "**+5.00%**"
    assert rows[-1] == [cut["model"], cut["precision"], cut["recompute"], "not run (the suite stopped before it)",
                        "", ""]
    assert "on every grid point: **not reached** (max |error| 5.00% at toy fp32 none; 1 of 2 points" in body
    assert table(body, "Kernels") == [
        ["rms_norm", "4096x768", "0.05", "0.20", "0.10", "4.00x", "6", "30", "12", "81% of copy bandwidth"],
        ["cut off by its time box after 240 s"] + [""] * 9]
    assert "device-to-device copy: 2900 GB/s" in body


def test_missing_markers_are_added_and_broken_ones_refused(results, tmp_path, capsys):
    bare = SAMPLE_DOC.replace(f"{BEGIN}\nNot yet measured on a GPU.\n{END}\n\n", "")
    text = merged(tmp_path, results, bare)
    head, tail = bare.split("## Kernels")
    assert text.startswith(head + BEGIN) and text.endswith(f"{END}\n\n## Kernels{tail}")  # end of the GPU section
    assert merged(tmp_path, results, text) == text

    other = "# Notes\n\nNo GPU section here, no final newline."
    text = merged(tmp_path, results, other)
    assert text.startswith(other + "\n\n" + BEGIN) and text.endswith(END + "\n")

    doc = tmp_path / "benchmarks.md"
    for broken in (SAMPLE_DOC + BEGIN, SAMPLE_DOC.replace(BEGIN, "@@").replace(END, BEGIN).replace("@@", END)):
        doc.write_bytes(broken.encode())
        assert merge_into(doc, results, "--allow-dry-run") == 1
        assert capsys.readouterr().err.startswith(f"error: {doc} must hold one {BEGIN} followed by one {END}")
        assert doc.read_bytes() == broken.encode()
