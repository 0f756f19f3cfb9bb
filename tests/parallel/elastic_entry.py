"""`kiln` under torchrun with a node failure planted, for tests/parallel/test_fleet.py:

    python -m torch.distributed.run ... tests/parallel/elastic_entry.py train CONFIG --run-dir DIR --auto-resume ...

KILN_TEST_KILL=RANK@STEP: on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0) that rank SIGKILLs itself
right after logging that step, as a node that dies does; torchrun restarts the group and the same command line
goes on. KILN_TEST_KILL_NODE=STEP: on any attempt, the worker of this "node" SIGKILLs its torchrun agent and then
itself right after logging that step: the node is gone for good and the other node's agent goes on alone
(--nnodes=1:2). KILN_TEST_SLEEP=RANK@STEP@SECONDS: that rank sleeps inside that step (a hung rank).
KILN_TEST_SLOW_SAVE=STEP@SECONDS: writing that step's checkpoint (state.pt) takes that much longer (a slow disk)."""
import faulthandler
import os
import signal
import sys
import time

from kiln.cli.main import main
from kiln.train import checkpoint, loop

faulthandler.register(signal.SIGUSR2)  # `kill -USR2 PID` prints where a hung rank is
rank, attempt = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if "TORCHELASTIC_USE_AGENT_STORE" in os.environ:  # under torchrun: which store the workers bootstrap from
    print(f"elastic_entry: rank {rank} TORCHELASTIC_USE_AGENT_STORE={os.environ['TORCHELASTIC_USE_AGENT_STORE']}",
          flush=True)

if os.environ.get("KILN_TEST_KILL") and attempt == 0:
    who, at = map(int, os.environ["KILN_TEST_KILL"].split("@"))
    if rank == who:
        log = loop.Trainer._log

        def _log(self, *args, **kw):
            log(self, *args, **kw)
            if self.state.step == at:
                os.kill(os.getpid(), signal.SIGKILL)

        loop.Trainer._log = _log

if os.environ.get("KILN_TEST_KILL_NODE"):
    at_step = int(os.environ["KILN_TEST_KILL_NODE"])
    logged = loop.Trainer._log

    def _log_then_go(self, *args, **kw):
        logged(self, *args, **kw)
        if self.state.step == at_step:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent first: nothing restarts this node's worker
            os.kill(os.getpid(), signal.SIGKILL)

    loop.Trainer._log = _log_then_go

if os.environ.get("KILN_TEST_SLEEP"):
    who, at, seconds = os.environ["KILN_TEST_SLEEP"].split("@")
    if rank == int(who):
        step = loop.train_step

        def train_step(*args, **kw):
            if loop_state["trainer"].state.step + 1 == int(at):
                time.sleep(float(seconds))
            return step(*args, **kw)

        loop_state = {}
        run = loop.Trainer.run

        def run_(self):
            loop_state["trainer"] = self
            return run(self)

        loop.Trainer.run, loop.train_step = run_, train_step

if os.environ.get("KILN_TEST_SLOW_SAVE"):
    at, seconds = os.environ["KILN_TEST_SLOW_SAVE"].split("@")
    write = checkpoint.write_state

    def slow_write(state, path):
        if f"step_{int(at):06d}" in path.parent.name:
            time.sleep(float(seconds))
        write(state, path)

    checkpoint.write_state = slow_write

sys.exit(main(sys.argv[1:]))
