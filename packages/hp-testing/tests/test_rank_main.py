"""An hp-run rank ends as ``python script.py`` would, only without interpreter finalization.

[Note: a rank ends without interpreter finalization] in ``hp_testing._rank_main`` says why.
Each script runs both ways and the observable ends must agree: exit status,
what reached stdout and stderr (including output a rank never flushed), atexit
handlers and non-daemon threads run first, ``sys.argv`` and ``sys.path[0]``.
Each run imports torch (through ``hp_testing``), so the cases are few: the module
target covers an integer status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ENDINGS = {
    "falls-off-the-end": "print('last line', end='')\n",
    "exit-message": "import sys\nsys.exit('stopping: no data')\n",
    "error": "raise ValueError('bad batch')\n",
    "interrupt": "raise KeyboardInterrupt\n",
}

PROLOGUE = """
import atexit, os, sys, threading, time
print('argv', sys.argv[1:], 'path0', os.path.basename(sys.path[0]))
atexit.register(lambda: print('atexit ran', flush=True))
def late():
    time.sleep(0.3)
    print('thread joined', flush=True)
threading.Thread(target=late).start()
"""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_rank_ends_as_python_does(tmp_path: Path, ending: str) -> None:
    folder = tmp_path / "scripts"
    folder.mkdir()
    script = folder / "job.py"
    script.write_text(textwrap.dedent(PROLOGUE) + ENDINGS[ending])
    python = _run([sys.executable, str(script), "--lr", "0.1"], cwd=tmp_path)
    ours = _run([sys.executable, "-m", "hp_testing._rank_main", str(script), "--lr", "0.1"], cwd=tmp_path)
    assert ours.returncode == python.returncode, (ours.stderr, python.stderr)
    assert ours.stdout == python.stdout
    assert "atexit ran" in ours.stdout and "thread joined" in ours.stdout
    assert ours.stdout.index("thread joined") < ours.stdout.index("atexit ran")
    assert "argv ['--lr', '0.1'] path0 scripts" in ours.stdout
    # tracebacks differ only in runpy's frames: the last line is the same
    assert ours.stderr.strip().splitlines()[-1:] == python.stderr.strip().splitlines()[-1:]
    if ending == "interrupt":
        assert ours.returncode == -signal.SIGINT
    if ending == "error":
        assert ours.returncode == 1 and "ValueError: bad batch" in ours.stderr


def test_a_module_target_runs_as_main(tmp_path: Path) -> None:
    body = "import sys\nif __name__ == '__main__':\n    print(sys.argv)\n    sys.exit(4)\n"
    (tmp_path / "jobmod.py").write_text(body)
    ours = _run([sys.executable, "-m", "hp_testing._rank_main", "-m", "jobmod", "x"], cwd=tmp_path)
    assert ours.returncode == 4, ours.stderr
    assert ours.stdout.strip().endswith("'x']")
