"""How the `kiln` process ends (kiln.cli.finish): flushed, its atexit handlers run and its exit code kept, without
the interpreter's teardown; a normal exit where a thread is still at work.

The child processes load kiln/cli/finish.py by its path: it needs only the standard library, and a bare Python
starts in ~0.05 s where `import kiln` (torch) takes seconds."""
import subprocess
import sys
from pathlib import Path

FINISH = Path(__file__).resolve().parents[2] / "kiln" / "cli" / "finish.py"
PRELUDE = f"""
import atexit, importlib.util, sys, threading, time
spec = importlib.util.spec_from_file_location("finish", {str(FINISH)!r})
finish = importlib.util.module_from_spec(spec)
spec.loader.exec_module(finish)

class Teardown:  # runs only when the interpreter tears its objects down
    def __del__(self):
        open(sys.argv[1] + "/teardown", "w").write("torn down")

mark = Teardown()
atexit.register(lambda: open(sys.argv[1] + "/atexit", "w").write("ran"))
log = open(sys.argv[1] + "/log", "w")
finish.freeze_loaded()  # as the `kiln` command does: the open file is among the frozen objects
log.write("still in the buffer")  # never flushed by the script itself
print("to stdout", end="")  # a pipe: block-buffered
"""


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + body, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)


def test_exit_process_flushes_everything_and_skips_the_teardown(tmp_path):
    done = _run(tmp_path, "finish.exit_process(3)")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "to stdout" and done.stderr == ""
    assert (tmp_path / "log").read_text() == "still in the buffer"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()  # os._exit: no teardown


def test_a_thread_at_work_gets_a_normal_exit(tmp_path):
    body = """
def work():
    time.sleep(0.3)
    open(sys.argv[1] + "/thread", "w").write("finished")

threading.Thread(target=work).start()  # not a daemon: a normal exit waits for it
assert not finish.fast_exit_safe()
finish.exit_process(5)
"""
    done = _run(tmp_path, body)
    assert done.returncode == 5, done.stderr
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "log").read_text() == "still in the buffer" and (tmp_path / "atexit").read_text() == "ran"
    assert done.stdout == "to stdout"
