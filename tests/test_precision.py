"""The precision modes' table (kiln/precision.py) against what the runtime does, and the rule that nothing else
compares a mode's name: a mode is one row, asked for what it does."""
import re
from pathlib import Path

import pytest
import torch

from kiln.memory.estimate import NUMERICS
from kiln.precision import AUTO, MODES, PRECISIONS, mode
from kiln.train.precision import Precision

KILN = Path(__file__).resolve().parent.parent / "kiln"
NAMES = "|".join(re.escape(m) for m in sorted(PRECISIONS, key=len, reverse=True))
# a mode's name compared with something (==, !=, in (...)), or a precision compared with "auto" (is_auto says it;
# other settings have an auto of their own). The peak tables keyed by dtype ("bf16": 989e12) are datasheets.
COMPARED = re.compile(rf"""(==|!=|\bin\s*[\(\[{{])\s*["']({NAMES})["']|["']({NAMES})["']\s*(==|!=)"""
                      r"""|(precision[\w.]*|requested)\s*(==|!=)\s*["']auto["']""")
LOOP = re.compile(r"\bfor\s+[\w, ]+\s+in\b")  # `for p in ("fp32", "bf16")` iterates, it does not compare


def compares_mode_names(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "precision.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARED.search(LOOP.sub("", line.split("#")[0])):
                hits.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    return hits


def test_no_precision_mode_is_compared_by_name_outside_its_table(tmp_path):
    assert compares_mode_names(KILN) == []
    # the check finds what it looks for (lines kiln/train/precision.py and kiln/memory/devices.py had before)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "devices.py").write_text(
        'if precision in ("bf16", "bf16-master"):\n    pass\nself.loss_scaling = mode == "fp16"\n'
        'if cfg.precision.mode == "auto":\n    pass\nif train.device == "auto":\n    pass\n'
        'for p in ("fp32", "bf16"):\n    pass\n')
    assert len(compares_mode_names(tmp_path)) == 3


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_each_row_is_what_the_runtime_and_the_estimator_use(name):
    row, runtime, num = mode(name), Precision(name, torch.device("cpu")), NUMERICS[name]
    assert runtime.autocast_dtype == row.autocast and runtime.param_dtype == row.param_dtype
    assert runtime.loss_scaling == row.loss_scaling
    # the estimator's bytes are the dtypes' sizes: parameters and gradients in the parameter dtype, matmul outputs
    # in the autocast dtype (or the parameters'), masters in fp32 beside half parameters
    size = row.param_dtype.itemsize
    assert (num.param, num.grad, num.residual) == (size, size, size)
    assert num.compute == (row.autocast or row.param_dtype).itemsize
    assert num.master == (4 if row.masters else 0) and num.autocast == (row.autocast is not None)
    assert row.masters == (row.param_dtype != torch.float32 and row.param_dtype.itemsize < 4)
    assert row.matmul == (row.autocast or row.param_dtype)


def test_auto_is_a_setting_not_a_mode():
    assert MODES == (AUTO, *PRECISIONS)
    with pytest.raises(ValueError, match="precision.mode='auto' is not a concrete mode.*resolve_mode"):
        mode(AUTO)
    with pytest.raises(ValueError, match="precision.mode='fp4' is not a concrete mode; use one of fp32, tf32"):
        mode("fp4")
