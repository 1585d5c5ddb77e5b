"""Metrics reach the endpoint Ray's Prometheus integration scrapes.

A real local Ray node with a known metrics export port runs a small job through ckptd: a
training worker (a Ray actor) saves through its coordinator, the driver saves a fenced staged
state, one commit fails because a reported file vanished (after a retried attempt), one unit
fails, two steps commit, a local mirror copies them, retention deletes old steps on both tiers,
a weight subscriber serves an older version and a step stays in flight. Then the test scrapes
``http://127.0.0.1:PORT/metrics`` over real HTTP, parses the text format, and checks every ckptd
series: the run label, and values that match what the job did.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

import ckptd
from ckptd import metrics as m
from tests.integration.helpers import SaveWorker, status

REPORT_INTERVAL_MS = "1000"  # Ray's default is 10 s; it does not export faster than once a second


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_port():
    """A Ray node of this module's own, exporting metrics on a known port every second."""
    if ray.is_initialized():
        ray.shutdown()
    saved = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = REPORT_INTERVAL_MS  # Ray's processes read it at start
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    port = _free_port()
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _metrics_export_port=port)
        yield port
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = saved


class Scrape:
    """One scrape of the endpoint: ckptd's samples, by sample name."""

    def __init__(self, port: int) -> None:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        self.samples: dict[str, list] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_ckptd_"):
                    self.samples.setdefault(s.name, []).append(s)

    def value(self, name: str, **labels: str) -> float | None:
        """The sum over every process (Ray labels each series with its WorkerId) of the samples
        of ``name`` with these labels; None if there is none."""
        found = [s.value for s in self.samples.get(name, ()) if all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found) if found else None


def test_every_metric_reaches_rays_prometheus_endpoint(metrics_port, tmp_path, run_name):
    root, mirror = str(tmp_path / "ckpt"), str(tmp_path / "mirror")
    faults = {"CKPTD_FAILPOINTS": "before_manifest=raise,before_tracker_rename=raise",
              "CKPTD_FAILPOINTS_ONCE": str(tmp_path / "once")}  # each fires once: one retry each
    monitor = ckptd.start_monitor(root, run=run_name, runtime_env={"env_vars": faults}, commit_retries=1,
                                  max_ckpt_to_keep=2, max_state_dict_to_keep=2,
                                  mirror={"url": mirror, "max_ckpt_to_keep": 2})
    worker = SaveWorker.remote(run_name, 0)
    driver = ckptd.CheckpointCoordinator(monitor, worker_id="driver")
    try:
        # Step 1: the unit succeeds, then its file vanishes: the commit (retried once after the
        # failpoint) fails its check. Step 2: a unit fails.
        ray.get(worker.save.remote(1))
        assert ray.get(worker.wait_all.remote()) is None
        os.remove(f"{ckptd.step_dir(root, 1)}/model_rank0.pt")
        driver.register(1, checkpoint_thread_count=1)
        with pytest.raises(ckptd.CheckpointSaveError, match="missing from storage"):
            driver.wait_committed(1, timeout_s=60)
        ray.get(worker.save.remote(2, fail=True))
        assert "disk full" in ray.get(worker.wait_all.remote())
        # Steps 3 to 5 commit and are mirrored (the first tracker write is retried once); step 4
        # also has a fenced staged save from the driver. Retention keeps two steps on each tier.
        for step in (3, 4, 5):
            ray.get(worker.save.remote(step))
            # Done before the driver writes into step 4: the worker's save_fn returns None, so its
            # files are found by time, and it would find (and count) the driver's file too.
            assert ray.get(worker.wait_all.remote()) is None
            units = 1
            if step == 4:
                driver.save_state_async("extra", {"w": torch.arange(1000, dtype=torch.float32)}, 4, fenced=True)
                driver.before_update()
                units = 2
            driver.register(step, checkpoint_thread_count=units)
            driver.wait_committed(step, timeout_s=60)
            driver.wait_mirrored(step, timeout_s=60)
            if step == 3:
                subscriber = ckptd.WeightSubscriber(run_name, kind="checkpoint", name="rollout-0")
                subscriber.report_serving(3)
        assert ray.get(monitor.wait_retention.remote(60))
        # Step 6 stays in flight: registered, never saved.
        driver.register(6, checkpoint_thread_count=1)
        st = status(monitor)
        assert st.retention.deleted_steps and st.mirror.deleted_steps
        pt = os.path.getsize(f"{ckptd.step_dir(root, 5)}/model_rank0.pt")
        st_bytes = os.path.getsize(f"{ckptd.step_dir(root, 4)}/extra.safetensors")

        ck = {"run": run_name, "kind": "checkpoint"}
        expected = {  # exact values: counts of what the job did
            "ray_ckptd_save_blocked_seconds_count": (ck, 6),  # 5 worker saves, 1 driver save
            "ray_ckptd_fence_wait_seconds_count": ({"run": run_name}, 1),
            "ray_ckptd_save_unit_duration_seconds_count": (ck, 5),  # steps 1, 3, 4 (two units), 5
            "ray_ckptd_save_unit_bytes_count": (ck, 5),
            "ray_ckptd_written_bytes_total": (ck, 4 * pt + st_bytes),
            "ray_ckptd_commit_latency_seconds_count": (ck, 3),
            "ray_ckptd_failed_units_total": (ck, 1),
            "ray_ckptd_failed_commits_total": (ck, 1),
            "ray_ckptd_failed_steps_total": (ck, 2),
            "ray_ckptd_retried_requests_total": ({"run": run_name, "request": "commit"}, 1),
            "ray_ckptd_retention_deletions_total": ({"run": run_name, "tier": "root"}, len(st.retention.deleted_steps)),
            "ray_ckptd_steps_in_flight": (ck, 1),
            "ray_ckptd_latest_committed_step": (ck, 5),
            "ray_ckptd_mirror_lag_steps": ({"run": run_name}, 0),
            "ray_ckptd_mirror_lag_seconds": ({"run": run_name}, 0),
            "ray_ckptd_served_version_lag_steps": (ck, 2),
            "ray_ckptd_live_subscribers": (ck, 1),
        }
        extra = {
            ("ray_ckptd_retried_requests_total", "tracker"): 1,
        }

        deadline, scrape, wrong = time.monotonic() + 60, None, {"not scraped yet": None}
        while wrong and time.monotonic() < deadline:
            try:
                scrape = Scrape(metrics_port)
            except OSError:  # the metrics agent is still starting
                time.sleep(0.5)
                continue
            wrong = {name: (scrape.value(name, **labels), f"want {want}") for name, (labels, want) in expected.items()
                     if scrape.value(name, **labels) != want}
            wrong.update({f"{name}{{request={req}}}": scrape.value(name, run=run_name, request=req)
                          for (name, req), want in extra.items()
                          if scrape.value(name, run=run_name, request=req) != want})
            mirror_deleted = scrape.value("ray_ckptd_retention_deletions_total", run=run_name, tier="mirror")
            if mirror_deleted != len(st.mirror.deleted_steps):
                wrong["mirror deletions"] = mirror_deleted
            if wrong:
                time.sleep(0.5)
        assert not wrong, f"series missing or with other values than the job produced: {wrong}"

        # Every metric ckptd defines was scraped, each series with the run label.
        for spec in m.METRICS:
            names = [n for n in scrape.samples if n == spec.exported or n.startswith(spec.exported + "_")]
            assert names, f"{spec.exported} was not scraped"
            for n in names:
                assert all(s.labels.get("run") == run_name for s in scrape.samples[n]), n
        # Histograms: Ray estimates _sum from bucket midpoints, so only plausible bounds hold.
        assert 0 < scrape.value("ray_ckptd_save_blocked_seconds_sum", **ck) < 30
        assert 0 < scrape.value("ray_ckptd_save_unit_duration_seconds_sum", **ck) < 120
        assert 0 < scrape.value("ray_ckptd_commit_latency_seconds_sum", **ck) < 60
        assert 0 < scrape.value("ray_ckptd_fence_wait_seconds_sum", run=run_name) < 30
        exact = 4 * pt + st_bytes
        assert exact / 4 <= scrape.value("ray_ckptd_save_unit_bytes_sum", **ck) <= exact * 4
        # Gauges: step 6 registered just now; a subscriber two steps behind.
        assert 0 < scrape.value("ray_ckptd_oldest_pending_step_age_seconds", **ck) < 120
        assert scrape.value("ray_ckptd_steps_in_flight", run=run_name, kind="state_dict") == 0
        assert 0 < scrape.value("ray_ckptd_served_version_lag_seconds", **ck) < 120
        subscriber.close()
    finally:
        ray.kill(worker)
        ray.kill(monitor, no_restart=True)

