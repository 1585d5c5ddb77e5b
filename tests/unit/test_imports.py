"""What importing ckptd costs a process: the monitor's, a relay's and the CLI's never import torch
(seconds of CPU each, at every monitor start and restart), and the lazy package still behaves
as the eager one did."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def imported_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter holds after running ``code``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(*sys.modules)"], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return {name.split(".")[0] for name in out.split()}


@pytest.mark.parametrize("module", ["ckptd.monitor.actor", "ckptd.coordinator.relay", "ckptd.cli"])
def test_the_monitor_a_relay_and_the_cli_import_without_torch(module):
    loaded = imported_after(f"import {module}")
    assert "ckptd" in loaded and "torch" not in loaded


def test_the_save_path_still_imports_what_it_needs():
    assert "torch" in imported_after("import ckptd; ckptd.CheckpointCoordinator")


def test_public_names_resolve_and_verify_and_resume_stay_functions_after_their_submodules():
    import ckptd.resume
    import ckptd.verify

    assert isinstance(ckptd.verify, types.FunctionType) and ckptd.verify.__module__ == "ckptd.verify"
    assert isinstance(ckptd.resume, types.FunctionType) and ckptd.resume.__module__ == "ckptd.resume"
    assert all(getattr(ckptd, name) is not None for name in ckptd.__all__)
    assert set(ckptd.__all__) <= set(dir(ckptd))
    with pytest.raises(AttributeError, match="no_such_name"):
        ckptd.no_such_name  # noqa: B018


def test_the_package_pickles_by_reference():
    from ray import cloudpickle

    import ckptd

    assert pickle.loads(pickle.dumps(ckptd)) is ckptd
    assert cloudpickle.loads(cloudpickle.dumps(lambda: ckptd.verify))() is ckptd.verify
