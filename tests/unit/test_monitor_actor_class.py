"""start_monitor builds its Ray actor class once per process."""

from __future__ import annotations

from ckptd.monitor.actor import CheckpointMonitor, monitor_actor_class


def test_every_monitor_of_a_process_uses_one_actor_class():
    # Ray fingerprints a class's code and exports it on its first use in a job (0.15 s per class
    # on this machine): a class per start_monitor call paid that on every start.
    first = monitor_actor_class()
    assert monitor_actor_class() is first
    assert first.__ray_metadata__.modified_class.__name__ == CheckpointMonitor.__name__
