"""procs.StopSignals, the trainer's stop rule, with real signals in a child process: the first
SIGTERM/SIGINT asks for a graceful stop, its echo right after changes nothing, a repeat after
`repeat_after` seconds stops at once."""
import subprocess
import sys

CHILD = """
import os, signal, time
from megatron_marsrl.procs import StopSignals

stop = StopSignals(repeat_after=0.5).install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # the echo of a launcher forwarding it again
time.sleep(0.1)
print("asked", stop.name, flush=True)
time.sleep(0.6)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)
    print("still running", flush=True)
except KeyboardInterrupt:
    print("stopped at once", flush=True)
"""


def test_a_second_signal_after_the_grace_stops_at_once_and_an_echo_does_not():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["asked SIGTERM", "stopped at once"]
    assert "SIGTERM received: stopping the running step" in proc.stderr
