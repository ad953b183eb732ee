"""Week 20: tensor-parallel ranks placed on the nodes of a Ray cluster (nanoserve/engine/ray_cluster.py).

Two Ray nodes on this one host, each started by its own `ray start` (a head and a node that joins
it, each with a resource naming it, its own ports and its own temp dir), stand in for two hosts.
An engine with two ranks then runs with its driver on one node and, spread, its worker on the
other, and writes the same greedy tokens as one process (float32).

The engines run in a child process (`python this_file.py ...`, `drive` below) rather than in
pytest's: Ray keeps one connection per process, with settings (such as the authentication mode of
the cluster it first met) that outlive `ray.shutdown`, and another test in this process may have
used a local cluster. The child reports each stage on a line as it reaches it, so a run that hangs
fails with the stage it hung in.

Only the processes these tests start are stopped, by pid: `ray stop` stops every Ray process of
the user on the machine, other tests' clusters included.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nanoserve.testing import free_ports

from nanoserve.engine.ray_cluster import driver_cuda_device, shortfall

ROOT = Path(__file__).resolve().parents[2]
HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("psutil") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="needs ray and psutil (pip install ray psutil): the test "
                                                    "starts two Ray nodes and finds their processes with psutil")
PROMPTS = ["The list", "A dictionary is a", "Once upon a time there was a"]
NODE_START_TIMEOUT = 60.0  # seconds for both nodes to join (each `ray start` takes ~10 s on a busy 2-core machine)
# A test cluster on the loopback of one host: no token. (Ray 2.5x turns token authentication on when
# ~/.ray/auth_token exists, which a local `ray.init()` writes; the nodes and the driver must agree.)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


# ----------------------------------------------------------------------------- no cluster needed


def test_a_shortfall_names_what_is_missing():
    two_nodes = {"a": {"CPU": 2.0}, "b": {"CPU": 2.0}}
    bundles = [{"GPU": 1.0, "CPU": 1.0}] * 2
    why = shortfall(bundles, "PACK", {"CPU": 4.0, "GPU": 1.0}, two_nodes | {"a": {"CPU": 2.0, "GPU": 1.0}}, "a")
    assert why == "the cluster has 1 GPU free, the group needs 2"
    why = shortfall(bundles, "PACK", {"CPU": 4.0, "GPU": 2.0}, two_nodes | {"b": {"CPU": 2.0, "GPU": 2.0}}, "a")
    assert why.startswith("rank 0 runs in this process, so its bundle must be on this process's node (a), which has no GPU")
    why = shortfall([{"CPU": 1.0}] * 3, "STRICT_SPREAD", {"CPU": 4.0}, two_nodes, "a")
    assert why == "strict-spread puts each rank on a node of its own: the group needs 3 nodes, the cluster has 2"
    assert "strict-pack puts every rank on one node" in shortfall([{"CPU": 1.0}] * 3, "STRICT_PACK", {"CPU": 4.0},
                                                                   two_nodes, "a")


def test_the_drivers_gpu_is_the_one_ray_reserved():
    assert driver_cuda_device(["3"], None) == "cuda:3"
    assert driver_cuda_device([3], "2,3") == "cuda:1"  # torch counts among the GPUs this process sees
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=0,1 hides it"):
        driver_cuda_device(["3"], "0,1")


def test_a_placement_without_ray_actors_is_refused():
    from nanoserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="--ray-placement spread places Ray actors: it needs --distributed-executor ray"):
        EngineConfig(tensor_parallel_size=2, ray_placement="spread")
    with pytest.raises(ValueError, match="unknown ray_placement 'scatter'"):
        EngineConfig(distributed_executor="ray", ray_placement="scatter")


# ------------------------------------------------------------------------------ two Ray nodes




def node_ports(first: int, head: bool) -> list[str]:
    """Every port a node listens on, fixed to the 32 ports from `first` (Ray's defaults would collide
    between two nodes of one host, and with other tests' clusters): 8 servers, 24 for its workers."""
    names = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
    args = [a for i, name in enumerate(names) for a in (name, str(first + i))]
    args += ["--min-worker-port", str(first + 8), "--max-worker-port", str(first + 31)]
    if head:  # the cluster's address (GCS), and the dashboard's port, which a head binds even with it off
        args += ["--head", "--port", str(first + 6), "--dashboard-port", str(first + 7), "--include-dashboard", "false"]
    return args


class TwoNodes:
    """A Ray head and a second node on this host, each a `ray start --block` process of its own
    (it stays in the foreground, so its pid and its children are the node's processes)."""

    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="nsray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
        self.first = free_ports(64)
        self.gcs_port = self.first + 6  # the head's --port (see node_ports)
        self.procs, self.seen = [], set()

    def start_both(self) -> None:
        self.start("node_a", self.first, head=True)
        self.start("node_b", self.first + 32, head=False)

    def start(self, name: str, first: int, head: bool) -> None:
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "2",
               "--resources", json.dumps({name: 1}), "--temp-dir", str(self.tmp / name),
               "--object-store-memory", str(80 * 2**20), "--disable-usage-stats", *node_ports(first, head)]
        if not head:
            cmd += ["--address", f"127.0.0.1:{self.gcs_port}"]
        with open(self.tmp / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | RAY_ENV))

    def processes(self) -> list:
        """The nodes' processes now, remembered: the `ray start` processes and all they started, and
        any other whose command line names this cluster's temp dir (one orphaned on the way)."""
        import psutil

        found = []
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                top = psutil.Process(p.pid)
                found += [top] + top.children(recursive=True)
        pids = {p.pid for p in found}
        for p in psutil.process_iter(["cmdline"]):
            if p.pid not in pids and any(str(self.tmp) in a for a in p.info["cmdline"] or []):
                found.append(p)
        self.seen |= {(p.pid, p.create_time()) for p in found}
        return found

    def stop(self) -> list[str]:
        """End every process of both nodes: SIGKILL the two `ray start` monitors (on SIGTERM they
        drain the node for up to 30 s), SIGTERM the rest, SIGKILL what is still there 5 s later.
        Returns the processes of the nodes still alive after all that (none, or a test fails)."""
        import psutil

        found = self.processes()
        for p in self.procs:
            p.kill()
        for p in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(found, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        for p in self.procs:
            p.wait(timeout=5)
        left = [p for p in psutil.process_iter(["pid", "name", "create_time"])
                if (p.info["pid"], p.info["create_time"]) in self.seen]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return [f"{p.info['pid']} {p.info['name']}" for p in left]

    def log_tail(self) -> str:
        return "\n".join(f"--- {f.name}\n" + f.read_text()[-1500:] for f in sorted(self.tmp.glob("*.log")))


@pytest.fixture(scope="module")
def nodes():
    if not HAVE_RAY:
        pytest.skip("needs ray and psutil (pip install ray psutil)")
    cluster = TwoNodes()
    try:
        cluster.start_both()
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"processes of the test's Ray nodes still running after they were stopped: {left}"


def run_driver(nodes: TwoNodes, task: str, timeout: float) -> dict:
    """Run `drive(task)` in a child process against the two nodes; its result, or a failure that
    names the stage it reached."""
    env = os.environ | RAY_ENV | {"RAY_ADDRESS": f"127.0.0.1:{nodes.gcs_port}", "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    try:
        out = subprocess.run([sys.executable, __file__, task], capture_output=True, text=True, timeout=timeout, env=env,
                             cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        stages = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the driver hung after {timeout:.0f} s; its stages so far:\n{stages}\n{nodes.log_tail()}")
    nodes.processes()  # the actors' processes among them, while their parents still stand
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines, f"{out.stdout}\n{out.stderr[-3000:]}\n{nodes.log_tail()}"
    return json.loads(lines[-1])


@needs_ray
@pytest.mark.slow
def test_two_ranks_on_two_nodes_equal_one_process(nodes):
    result = run_driver(nodes, "spread-and-pack", timeout=150)
    node_of = result["node_of"]  # node id -> its name (the resource it was started with)
    assert sorted(node_of.values()) == ["node_a", "node_b"]
    spread, pack = result["spread"], result["pack"]
    assert spread["tokens"] == result["one_process"] and pack["tokens"] == result["one_process"]
    # spread: rank 0 on the driver's node, rank 1 on the other; pack: both on the driver's
    assert spread["ranks"][0] == result["driver"] and spread["ranks"][1] != result["driver"]
    assert {node_of[n] for n in spread["ranks"]} == {"node_a", "node_b"}
    assert pack["ranks"] == [result["driver"], result["driver"]]
    for run in (spread, pack):
        assert run["group_state"] == "REMOVED" and run["close_s"] < 10
        assert run["connected_after_close"] is False  # the engine disconnected: it had connected


@needs_ray
@pytest.mark.slow
def test_a_cluster_without_room_fails_within_the_timeout(nodes):
    result = run_driver(nodes, "no-room", timeout=90)
    strict, many = result["strict-spread"], result["pack"]
    assert "the group needs 3 nodes, the cluster has 2" in strict["error"]
    assert "the cluster has 4 CPU free, the group needs 5" in many["error"]
    for run in (strict, many):
        assert run["type"] == "PlacementFailed" and "\n" not in run["error"]
        assert run["seconds"] < 3 + 10  # the placement timeout, and the look at what is free
    assert result["groups_left"] == []


# ------------------------------------------------------------------------ the driver (child process)


def stage(name: str) -> None:
    print(json.dumps({"stage": name, "t": round(time.monotonic(), 1)}), flush=True)


def wait_for_two_nodes() -> dict[str, str]:
    """Connect, wait for both nodes to be up, and disconnect (each engine connects by itself).
    Returns each node's id -> its name."""
    import ray

    deadline = time.monotonic() + NODE_START_TIMEOUT
    while True:  # the head may still be starting
        try:
            ray.init(log_to_driver=False)
            break
        except ConnectionError:
            assert time.monotonic() < deadline, f"no Ray head at {os.environ['RAY_ADDRESS']} after {NODE_START_TIMEOUT:.0f} s"
            time.sleep(1)
    while len(alive := [n for n in ray.nodes() if n["Alive"]]) < 2:
        assert time.monotonic() < deadline, f"only {len(alive)} Ray node(s) up after {NODE_START_TIMEOUT:.0f} s"
        time.sleep(0.2)
    names = {n["NodeID"]: next(r for r in n["Resources"] if r.startswith("node_")) for n in alive}
    ray.shutdown()
    return names


def one_run(placement: str, tp: int = 2, timeout: float = 60.0) -> dict:
    """Build a tensor-parallel engine on the cluster, generate, close it; what happened."""
    import ray
    import torch
    from ray.util.placement_group import placement_group_table

    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    stage(f"{placement}: starting the engine")
    llm = LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=tp, distributed_executor="ray",
              ray_placement=placement, distributed_timeout=timeout)
    cluster = llm.engine.workers.cluster
    stage(f"{placement}: engine up, generating")
    tokens = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    ranks, group = list(cluster.nodes), cluster.group
    stage(f"{placement}: closing")
    start = time.monotonic()
    llm.close()
    close_s = time.monotonic() - start
    connected = ray.is_initialized()
    ray.init(log_to_driver=False)  # again, to ask about the group
    state = placement_group_table(group)["state"]
    ray.shutdown()
    stage(f"{placement}: closed")
    return {"tokens": tokens, "ranks": ranks, "group_state": state, "close_s": close_s,
            "connected_after_close": connected}


def drive(task: str) -> dict:
    import torch

    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    stage("waiting for the nodes")
    node_of = wait_for_two_nodes()
    if task == "no-room":
        return no_room()
    one = LLM("tiny", device="cpu", dtype=torch.float32)
    tokens = [o.token_ids for o in one.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    stage("one process done")
    import ray

    ray.init(log_to_driver=False)
    driver = ray.get_runtime_context().get_node_id()
    ray.shutdown()
    return {"node_of": node_of, "one_process": tokens, "driver": driver, "spread": one_run("spread"),
            "pack": one_run("pack")}


def no_room() -> dict:
    """3 ranks one per node on 2 nodes, and 5 ranks on 4 CPUs: each fails after the 3 s placement timeout."""
    import ray
    import torch
    from ray.util.placement_group import placement_group_table

    from nanoserve.engine.engine import LLM

    out = {}
    for placement, tp in (("strict-spread", 3), ("pack", 5)):
        stage(f"{placement} x{tp}")
        start = time.monotonic()
        try:
            LLM("tiny", device="cpu", dtype=torch.float32, tensor_parallel_size=tp, distributed_executor="ray",
                ray_placement=placement, distributed_timeout=3)
            out[placement] = {"type": None, "error": "the engine started", "seconds": 0}
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[placement] = {"type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - start}
    ray.init(log_to_driver=False)
    out["groups_left"] = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    ray.shutdown()
    return out


if __name__ == "__main__":  # the driver: python tests/week20/test_ray_nodes.py TASK
    print(json.dumps(drive(sys.argv[1])), flush=True)
