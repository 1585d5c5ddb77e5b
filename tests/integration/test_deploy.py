"""deploy/: the manifests hold what ckptd depends on, and the two-node recipe really runs.

The manifest tests parse every YAML file under deploy/ and check the parts that a job using
ckptd needs: the kind of object, the entrypoint, the ckptd version (pyproject's), the storage
settings (an s3:// root and a mirror) and the credentials (from a Secret or an instance role,
never written in the file). The cluster-launcher file is validated against Ray's own schema
(shipped with ray); the KubeRay manifests against KubeRay's CRDs when ``KUBERAY_CRDS`` names a
directory holding ``ray.io_rayjobs.yaml`` and ``ray.io_rayclusters.yaml`` (they are not vendored
here), with unknown fields refused as ``kubectl apply --validate=strict`` refuses them.

The two-node tests run deploy/local/two_nodes.sh: two ``ray start`` nodes on this machine (own
temp directories, ports, auth token and session, so they touch no other Ray instance), the
demo's ranks spread over both. With one shared root it passes; with node-local roots ckptd's
shared-root check refuses the run and says why.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import pytest
import yaml

import ckptd

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SECRET = "ckptd-s3-credentials"
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def pyproject_version() -> str:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


def the(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {[d.get('kind') for d in docs]}"
    return found[0]


def ray_containers(cluster_spec: dict) -> list[dict]:
    """Every container of the head group and of every worker group."""
    groups = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def demo_args(command: str | list[str]) -> dict[str, str]:
    """The options of the ``ckptd demo`` in a command line (a string or argv)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    assert "ckptd" in argv and argv[argv.index("ckptd") + 1] == "demo", argv
    from ckptd.cli import build_parser

    build_parser().parse_args(argv[argv.index("ckptd") + 1:])  # ckptd's own parser accepts it (or exits 2)
    args, rest = {}, argv[argv.index("ckptd") + 2:]
    while rest:
        word = rest.pop(0)
        if "=" in word:
            key, value = word.split("=", 1)
        else:
            key, value = word, rest.pop(0)
        args[key] = value
    return args


def check_storage(args: dict[str, str]) -> None:
    assert args["--address"] == "auto"  # joins the cluster the job runs on
    assert re.fullmatch(r"s3://[a-z0-9.-]+/\S+", args["--root"]), args
    assert re.fullmatch(r"s3://[a-z0-9.-]+/\S+", args["--mirror"]), args
    assert args["--mirror"] != args["--root"]


def pip_pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?==(\S+)", req.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def check_credentials(containers: list[dict]) -> None:
    """Every Ray container takes the S3 keys from the Secret, and none has them as literals."""
    assert containers
    for c in containers:
        env = {e["name"]: e for e in c.get("env", [])}
        for key in AWS_KEYS[:2]:
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": key}, (c["name"], key)
        for key in AWS_KEYS:
            assert "value" not in env.get(key, {}), f"{c['name']}: {key} is written in the manifest"
        assert env["AWS_DEFAULT_REGION"]["value"]


def check_image(containers: list[dict], ray_version: str) -> None:
    for c in containers:
        assert c["image"].startswith(f"rayproject/ray:{ray_version}-"), c["image"]


def test_every_yaml_under_deploy_is_checked():
    files = sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*.y*ml"))
    assert files == ["cluster-launcher.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"]
    for name in files:
        assert documents(name)  # parses, and is not empty


def test_rayjob_runs_the_demo_with_an_s3_root_a_mirror_and_the_pinned_ckptd():
    job = the(documents("kuberay/rayjob.yaml"), "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    check_storage(demo_args(job["spec"]["entrypoint"]))
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert pip_pins(runtime_env["pip"]) == {"ckptd": pyproject_version()}
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    cluster = job["spec"]["rayClusterSpec"]
    containers = ray_containers(cluster)
    check_credentials(containers)
    check_image(containers, cluster["rayVersion"])
    for c in containers:  # the monitor, the driver and the ranks all need memory and CPU
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]


def test_raycluster_and_its_submitter_run_the_demo_with_an_s3_root_a_mirror_and_the_pinned_ckptd():
    docs = documents("kuberay/raycluster.yaml")
    cluster = the(docs, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    containers = ray_containers(cluster["spec"])
    check_credentials(containers)
    check_image(containers, cluster["spec"]["rayVersion"])
    submitter = the(docs, "Job")
    assert submitter["apiVersion"] == "batch/v1"
    (container,) = submitter["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["ray", "job", "submit"]
    # It submits to this cluster's head service (KubeRay names it <cluster>-head-svc).
    assert f"--address=http://{cluster['metadata']['name']}-head-svc:8265" in command
    env_json = next(a.split("=", 1)[1] for a in command if a.startswith("--runtime-env-json="))
    assert pip_pins(yaml.safe_load(env_json)["pip"]) == {"ckptd": pyproject_version()}
    check_storage(demo_args(command[command.index("--") + 1:]))


def test_cluster_launcher_installs_the_pinned_ckptd_and_sets_the_storage_without_keys():
    (config,) = documents("cluster-launcher.yaml")
    assert config["provider"]["type"] == "aws"
    installs = [w for cmd in config["setup_commands"] if cmd.startswith("pip install")
                for w in shlex.split(cmd)[2:] if not w.startswith("-")]
    import ray

    assert pip_pins(installs) == {"ckptd": pyproject_version(), "ray": ray.__version__}
    exports = dict(re.findall(r"export (\w+)=(\S+)'", "\n".join(config["setup_commands"])))
    check_storage({"--address": "auto", "--root": exports["CKPTD_ROOT"], "--mirror": exports["CKPTD_MIRROR"]})
    text = (DEPLOY / "cluster-launcher.yaml").read_text()
    assert not [key for key in AWS_KEYS if key in text]
    for node_type in config["available_node_types"].values():  # S3 access from the instance role
        assert node_type["node_config"]["IamInstanceProfile"]["Arn"].startswith("arn:aws:iam::")
    # The command the file documents runs the demo with that storage.
    documented = next(line for line in text.splitlines() if "ckptd demo" in line)
    args = demo_args(documented.strip("#' \\").strip())
    assert args["--root"] == '$CKPTD_ROOT' and args["--mirror"] == '$CKPTD_MIRROR'


def test_cluster_launcher_passes_rays_own_config_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    (config,) = documents("cluster-launcher.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))
    broken = copy.deepcopy(config)
    broken["available_node_types"]["ray.worker.trainers"]["min_workers"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        validate_config(prepare_config(broken))


def strict(schema: dict) -> dict:
    """A CRD's schema with unknown fields refused (the API server would prune them silently;
    ``kubectl --validate=strict`` refuses them)."""
    schema = dict(schema)
    if "properties" in schema and "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for key in ("properties", "patternProperties"):
        if key in schema:
            schema[key] = {k: strict(v) for k, v in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            schema[key] = [strict(s) for s in schema[key]]
    return schema


@pytest.mark.parametrize(("manifest", "crd", "kind"), [
    ("kuberay/rayjob.yaml", "ray.io_rayjobs.yaml", "RayJob"),
    ("kuberay/raycluster.yaml", "ray.io_rayclusters.yaml", "RayCluster"),
])
def test_kuberay_manifests_match_the_crds(manifest, crd, kind):
    crds = os.environ.get("KUBERAY_CRDS")
    if not crds:
        pytest.skip("set KUBERAY_CRDS to a directory with KubeRay's CRDs (ray-operator/config/crd/bases)")
    definition = yaml.safe_load((Path(crds) / crd).read_text())
    assert definition["spec"]["names"]["kind"] == kind
    version = next(v for v in definition["spec"]["versions"] if v["name"] == "v1")
    validator = jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))
    doc = the(documents(manifest), kind)
    assert [e.message for e in validator.iter_errors(doc)] == []
    typo = copy.deepcopy(doc)
    typo["spec"]["entrypiont" if kind == "RayJob" else "rayVersoin"] = "x"
    assert list(validator.iter_errors(typo))  # the check can fail


# -- the two-node recipe ----------------------------------------------------------------------


def run_two_nodes(mode: str, work: Path, *demo: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **(env or {})}
    env.update(PYTHON=sys.executable, CKPTD_TWO_NODES_DIR=str(work),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if os.geteuid() == 0:
        # The other test workers keep both cores busy: a node's dashboard agent can miss its
        # raylet's fixed 15 s wait for its port files (seen in full runs: the worker node failed
        # all three starts). The nodes start at a higher priority, and go back to normal once up.
        env.setdefault("CKPTD_TWO_NODES_START_NICE", "-10")
    proc = subprocess.Popen([str(DEPLOY / "local" / "two_nodes.sh"), mode, *demo], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the script's trap stops both nodes (SIGKILL would leave them running)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"two_nodes.sh {mode} did not finish within 480 s\n{stdout}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def processes_under(work: Path) -> dict[int, str]:
    """The live processes whose command lines mention ``work`` (the nodes' temp directories)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(work) in cmd and state != "Z":
            found[int(pid)] = cmd[:200]
    return found


@pytest.fixture
def work():
    # Short: Ray's Unix sockets live under the nodes' temp directories (108 bytes at most).
    path = Path(tempfile.mkdtemp(prefix="ckptd-2n.", dir="/tmp"))
    yield path
    for pid in processes_under(path):  # only if the script failed to stop its nodes (the tests say so)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


def output(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"


@pytest.mark.timeout(600)
def test_two_nodes_with_a_shared_root_train_on_both_nodes_and_commit(work, s3_server):
    # The mirror on S3, with the credentials in the standard AWS variables only, as a pod gets
    # them from the Secret: every node's processes (the monitor uploads) must find them there.
    mirror = f"s3://{s3_server.new_bucket()}/two-nodes"
    options = s3_server.options()
    aws = {"AWS_ENDPOINT_URL": options["endpoint_url"], "AWS_ACCESS_KEY_ID": options["key"],
           "AWS_SECRET_ACCESS_KEY": options["secret"], "AWS_DEFAULT_REGION": "us-east-1"}
    proc = run_two_nodes("shared", work, "--steps", "3", "--ckpt-every", "3", "--mirror", mirror, env=aws)
    assert proc.returncode == 0, output(proc)
    out = proc.stdout
    assert "Ray cluster: 2 node(s)" in out, output(proc)
    # The two ranks ran on two nodes; on resume, three ranks over the same two.
    first = re.findall(r"rank (\d) runs on node (\w+)", out)
    assert [r for r, _ in first] == ["0", "1", "0", "1", "2"], out
    assert first[0][1] != first[1][1], out
    assert {n for _, n in first[2:]} == {first[0][1], first[1][1]}, out
    assert "model and AdamW state equal the 2 ranks': yes; next losses match: yes" in out, out
    assert "weights equal: yes" in out and "from_pretrained outputs equal the FSDP2 model's: yes" in out, out
    root = work / "mnt" / "ckpt"
    assert f"mirrored:                   step 3 -> {mirror}: yes" in out, out
    # Both nodes wrote under the one root: each rank's shard is in the committed step.
    assert ckptd.verify(str(root), 3).step == 3
    assert sorted(p.name for p in (root / "global_step_3" / "model").glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors"]
    assert ckptd.latest_step(mirror, storage_options=options) == 3
    assert options["secret"] not in proc.stdout + proc.stderr
    assert processes_under(work) == {}  # the script stopped both nodes


@pytest.mark.timeout(600)
def test_two_nodes_with_node_local_roots_are_refused_by_the_shared_root_check(work):
    proc = run_two_nodes("node-local", work, "--steps", "3", "--ckpt-every", "3")
    assert proc.returncode == 1, output(proc)
    assert "Ray cluster: 2 node(s)" in proc.stdout, output(proc)
    root = work / "mnt" / "ckpt"
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED: ")]
    assert len(failed) == 1, output(proc)
    message = failed[0]
    assert f"checkpoint root '{root}' is not shared storage" in message
    assert "Every worker and the monitor must see the same storage" in message
    # It names both nodes: the writer of the probe, and the monitor that could not read it.
    assert len(set(re.findall(r"node (\w{12}) \(", message))) == 2, message
    assert "Traceback" not in proc.stderr, output(proc)
    # Nothing was committed on either node's disk.
    assert not list(root.glob("global_step_*")) and not list((work / "worker-disk").glob("**/global_step_*"))
    assert processes_under(work) == {}


def test_every_demo_command_in_deploy_is_accepted_by_the_real_command_line():
    """The entrypoints the manifests run parse with ckptd's own parser (an option renamed in the
    CLI must fail here, not in a pod). The command itself runs in the two-node tests, and S3
    roots in test_s3.py."""
    from ckptd.cli import build_parser

    job = the(documents("kuberay/rayjob.yaml"), "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    args = build_parser().parse_args(argv[argv.index("ckptd") + 1:])
    assert (args.command, args.address) == ("demo", "auto")
    assert args.root.startswith("s3://") and args.mirror.startswith("s3://") and args.root != args.mirror
    assert args.ckpt_every <= args.steps

