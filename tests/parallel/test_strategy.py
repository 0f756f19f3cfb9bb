"""parallel.strategy's rules live in one table (kiln.parallel.strategy): kiln.config refuses exactly the combinations
the planner leaves out of its search, with the table's own words, and no other module compares strategy names."""
import ast
import itertools
from pathlib import Path

import pytest

from kiln.config import Config, ConfigError, apply_overrides
from kiln.memory.planner import Choice, _valid
from kiln.parallel.layout import ParallelPlan
from kiln.parallel.strategy import STRATEGIES

KILN = Path(__file__).resolve().parents[2] / "kiln"


def test_config_refuses_what_the_planner_skips():
    refused = dict.fromkeys(STRATEGIES, 0)
    for name, offload, precision, optimizer in itertools.product(
            STRATEGIES, ("none", "host"), ("fp32", "bf16", "bf16-master"), ("adamw", "adamw8bit", "sgd")):
        choice = Choice(precision, 1, 1, "none", optimizer=optimizer, optim_offload=offload,
                        plan=ParallelPlan(2, strategy=name))
        why = STRATEGIES[name].refusal(optim_offload=offload, precision=precision, optimizer=optimizer)
        try:
            apply_overrides(Config(), {"parallel.strategy": name, "optim.offload": offload,
                                       "precision.mode": precision, "optim.name": optimizer})
            accepted, message = True, None
        except ConfigError as e:
            accepted, message = False, str(e)
        assert accepted == _valid(choice) == (why is None), (name, offload, precision, optimizer)
        assert message == why
        refused[name] += not accepted
    # of 18 each: fsdp refuses the 9 with offload, 3 more in bf16-master, 2 more with adamw8bit; zero1 the 9 with
    # offload and 3 more with adamw8bit
    assert refused == {"none": 0, "ddp": 0, "zero1": 12, "fsdp": 14}


def test_no_module_but_the_table_names_a_strategy():
    """A strategy name as a string constant anywhere in kiln but kiln/parallel/strategy.py is a rule written twice
    (messages that name one, "--parallel.strategy=fsdp", are longer strings and do not count)."""
    names = set(STRATEGIES) - {"none"}  # "none" is every lever's off value (recompute, offload, ...)
    found = []
    for path in sorted(KILN.rglob("*.py")):
        if path.name == "strategy.py" and path.parent.name == "parallel":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(KILN.parent)}:{node.lineno} {node.value!r}")
    assert not found, "ask kiln.parallel.strategy instead: " + ", ".join(found)
