"""A reader that closes stdout early (``stepgraph bench | head -1``) ends the command quietly,
as ``cat`` does: no error line, no traceback, the shell's SIGPIPE status."""

from __future__ import annotations

import subprocess
import sys

from stepgraph.cli_args import SIGPIPE_STATUS, run_main


def _closed_early(func) -> int:
    def run(argv):
        return func()

    return run_main(run, [])


def test_a_closed_pipe_inside_the_command_is_quiet(capsys):
    def write():
        raise BrokenPipeError(32, "Broken pipe")

    assert _closed_early(write) == SIGPIPE_STATUS
    assert capsys.readouterr().err == ""


def test_other_file_errors_still_say_one_line(capsys):
    def write():
        raise PermissionError(13, "Permission denied")

    assert _closed_early(write) == 2
    assert capsys.readouterr().err.startswith("stepgraph: error: ")


def test_a_reader_that_leaves_before_the_first_line_ends_it_quietly():
    """The read end closes before the command writes: its first write fails with EPIPE."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepgraph", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # before the interpreter has even imported torch
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == SIGPIPE_STATUS, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception" not in err, err
