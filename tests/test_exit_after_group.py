"""A process that left a torch.distributed group exits at once with its status, output
flushed (gloo's threads can abort at interpreter exit); any other returns its status."""

from __future__ import annotations

import os

import pytest

from stepgraph.model import launch


def test_returns_the_status_without_a_group(monkeypatch):
    monkeypatch.setattr(launch, "_LEFT_GROUP", [])
    assert launch.exit_after_group(3) == 3


def test_exits_at_once_after_leaving_a_group(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_LEFT_GROUP", [True])

    def fake_exit(status):
        raise SystemExit(("os._exit", status))

    monkeypatch.setattr(os, "_exit", fake_exit)
    print("rank 0's table")
    with pytest.raises(SystemExit) as e:
        launch.exit_after_group(2)
    assert e.value.code == ("os._exit", 2)
    assert "rank 0's table" in capsys.readouterr().out
