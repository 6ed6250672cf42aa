"""``specdec serve --replicas``: option checks that need no Ray (``make test-ray`` runs the
replicas themselves)."""

from __future__ import annotations

import importlib.util

import pytest

from specdec.cli import main


def test_replicas_without_ray_is_a_clear_error(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    assert main(["serve", "--replicas", "2", "--port", "8765"]) == 2
    assert "--replicas needs Ray Serve: pip install 'specdec[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, message",
    [("--replicas", "--replicas must be >= 1"), ("--cpus-per-replica", "--cpus-per-replica")],
)
def test_bad_replica_options_are_refused_before_loading(capsys, flag, message):
    assert main(["serve", flag, "0"]) == 2
    assert message in capsys.readouterr().err


def test_cpus_per_replica_needs_replicas(capsys):
    assert main(["serve", "--cpus-per-replica", "2", "--port", "8765"]) == 2
    assert "--cpus-per-replica applies to Ray Serve replicas" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_bad_stats_interval_is_refused_before_loading(capsys, value):
    assert main(["serve", "--log-stats-interval", value, "--port", "8765"]) == 2
    assert "--log-stats-interval must be a number of seconds > 0" in capsys.readouterr().err
