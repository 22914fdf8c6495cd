"""The Makefile's install output filter (issue 28): it drops pip's noise about local index folders
and passes every other line on as it comes, also when its output is a pipe (`make run | tee`)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO


def quiet_filter() -> str:
    """The shell command of `QUIET_FILTER`, as `make` runs it (bash)."""
    [line] = [line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("QUIET_FILTER := ")]
    return line.removeprefix("QUIET_FILTER := ")


@pytest.mark.timeout(60)  # a filter that holds lines back never answers the first readline
def test_the_install_filter_passes_each_line_on_at_once_into_a_pipe_and_drops_the_index_noise() -> None:
    process = subprocess.Popen(["bash", "-c", quiet_filter()], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b"WARNING: Location '/wheels/' is ignored: it is either a non-existing path or lacks a file\n")
    process.stdin.write(b"Collecting torch==2.13.0\n")
    process.stdin.flush()
    assert process.stdout.readline() == b"Collecting torch==2.13.0\n"  # while its input is still open
    process.stdin.write(b"Installing collected packages: torch\n")
    process.stdin.close()
    assert process.stdout.read() == b"Installing collected packages: torch\n"
    assert process.wait() == 0
