"""Run by tests/memory/test_rank_peak.py under `torchrun --nproc_per_node=2`: one rank's whole-step peak (model
state, saved tensors, gathered parameters, DDP's buckets: everything its CPU allocator holds) for each scenario, in
one launch. Each rank writes OUT/rank{R}.json: {scenario: [step peaks]}."""
import json
import os
import sys
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.run.measure import measure_rank_peaks
from tests.memory.test_rank_peak import SCENARIOS, overrides

out = Path(sys.argv[1])
peaks = {name: measure_rank_peaks(load_config(None, overrides(name)), torch.device("cpu"), steps=5)
         for name in SCENARIOS}
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(peaks))
