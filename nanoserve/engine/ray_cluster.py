"""Week 20: the ranks of a tensor-parallel engine placed on the nodes of a Ray cluster.

Week 18's `Workers` can start ranks 1..N-1 as Ray actors (`--distributed-executor ray`). Left to
itself, Ray puts each actor wherever a GPU is free at that moment: two ranks of one engine on two
hosts when a neighbour on the first host would have had NVLink, or a worker on the very GPU the
driver (rank 0, in the engine's own process, which Ray knows nothing about) is using. So the ranks
first ask for a *placement group*: one bundle of resources per rank, reserved all at once or not at
all, and each worker actor then runs inside its own bundle:

    bundle 0   {"GPU": 1, "CPU": 1}   pinned to the driver's node: rank 0 uses that GPU
    bundle 1   {"GPU": 1, "CPU": 1}   rank 1's actor
    ...                               ({"CPU": 1} each on the CPU)

Bundle 0 is held by a *seat*, a small actor that does nothing but sit there, so that no other actor
can take rank 0's GPU, and that tells the driver which GPU Ray reserved for it (`driver_cuda_device`).
It must be on the driver's own node (a GPU on another host is no use to this process); a label
selector on Ray's node id pins it there (`ray.io/node-id`; the older `node:<ip>` resource cannot
tell apart two nodes that share an address, as the tests' two nodes on one host do).

Where the other bundles go is the placement strategy (`--ray-placement`):
    pack           (the default) as few nodes as possible: tensor parallelism all-reduces twice per
                   layer, and only within one host do those go over NVLink
    spread         over as many nodes as possible, e.g. one GPU per host
    strict-pack    one node or fail
    strict-spread  one rank per node or fail (what pipeline stages across hosts want)

The ranks then meet at `tcp://<driver node's IP>:<port>` (week 18's `init_group`): the IP other
hosts know the driver by, not 127.0.0.1. docs/parallelism.md ("Across nodes with Ray") lists the
commands for a cluster of several hosts and the ports between them that must be open.
"""

from __future__ import annotations

import os
import time
from collections import Counter

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict-pack": "STRICT_PACK", "strict-spread": "STRICT_SPREAD"}
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id
CLOSE_TIMEOUT = 10.0  # seconds `RayRanks.close` may take: the workers' own exit, then the group's removal


class PlacementFailed(ValueError):
    """The Ray cluster has no room for the ranks: a setting asked for more than the cluster has
    (a ValueError, so the command line reports it in one line)."""


def connect(pythonpath: str) -> bool:
    """Join the cluster that RAY_ADDRESS names (else the one `ray start` last started on this
    machine, else start a local one), unless this process already has. Every actor gets
    `pythonpath` first on its path, so that it runs the driver's nanoserve. Returns True if this
    call connected (so the caller disconnects when it is done)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor ray needs Ray: pip install ray") from None
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    except ConnectionError as e:
        raise ValueError(f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({e}): start it with `ray start "
                         "--head` on the head node, or unset RAY_ADDRESS for a local one") from None
    return True


def rank_bundles(size: int, cuda: bool) -> list[dict[str, float]]:
    """One bundle per rank: a GPU and a CPU for its process on CUDA, a CPU on the CPU."""
    return [{"GPU": 1.0, "CPU": 1.0} if cuda else {"CPU": 1.0} for _ in range(size)]


def driver_cuda_device(gpu_ids: list, visible: str | None) -> str:
    """The torch device of the GPU Ray reserved for rank 0. Ray numbers a node's GPUs as its
    raylet saw them; this process sees them through its own CUDA_VISIBLE_DEVICES (`visible`), if set,
    and torch counts from 0 among those it sees."""
    if len(gpu_ids) != 1:
        raise RuntimeError(f"Ray gave rank 0's bundle {len(gpu_ids)} GPUs, not 1")
    gpu = str(gpu_ids[0])
    if not visible:
        return f"cuda:{gpu}"
    order = [d.strip() for d in visible.split(",")]
    if gpu not in order:
        raise ValueError(f"Ray reserved GPU {gpu} for rank 0, but CUDA_VISIBLE_DEVICES={visible} hides it from this "
                         "process: start the driver with the same CUDA_VISIBLE_DEVICES as its node's `ray start`")
    return f"cuda:{order.index(gpu)}"


def shortfall(bundles: list[dict], strategy: str, free: dict, nodes: dict[str, dict], driver_node: str) -> str:
    """Why `bundles` found no room: what the cluster has `free` (summed over its nodes) against what
    the group needs, the driver's node against bundle 0, and the strict strategies' node counts.
    `nodes`: each live node's total resources, by node id."""
    need = Counter()
    for bundle in bundles:
        need.update(bundle)
    why = [f"the cluster has {free.get(r, 0):g} {r} free, the group needs {n:g}" for r, n in need.items()
           if free.get(r, 0) < n]
    lacking = [r for r, n in bundles[0].items() if nodes.get(driver_node, {}).get(r, 0) < n]
    if lacking:
        why.append(f"rank 0 runs in this process, so its bundle must be on this process's node ({driver_node[:12]}), "
                   f"which has no {' or '.join(lacking)}")
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        why.append(f"strict-spread puts each rank on a node of its own: the group needs {len(bundles)} nodes, "
                   f"the cluster has {len(nodes)}")
    if strategy == "STRICT_PACK" and not any(all(t.get(r, 0) >= n for r, n in need.items()) for t in nodes.values()):
        why.append(f"strict-pack puts every rank on one node: no node has {dict(need)}")
    if not why:
        why.append(f"the free resources ({free}) add up, but not node by node, or other jobs hold them")
    return "; ".join(why)


def place_ranks(size: int, cuda: bool, placement: str, driver_node: str, timeout: float):
    """Reserve one bundle per rank, bundle 0 on `driver_node`, and wait for all of them (a
    placement group is all or nothing). Raises PlacementFailed, naming what is missing, when the
    cluster cannot make room within `timeout` seconds (Ray itself would wait for ever, in case an
    autoscaler adds nodes)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if placement not in PLACEMENTS:
        raise ValueError(f"unknown Ray placement {placement!r}: one of {', '.join(PLACEMENTS)}")
    bundles = rank_bundles(size, cuda)
    selectors = [{NODE_ID_LABEL: driver_node}] + [{} for _ in range(size - 1)]
    group = placement_group(bundles, strategy=PLACEMENTS[placement], bundle_label_selector=selectors)
    if group.wait(timeout):
        return group
    remove_placement_group(group)
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    why = shortfall(bundles, PLACEMENTS[placement], ray.available_resources(), nodes, driver_node)
    raise PlacementFailed(f"the Ray cluster found no room for {size} tensor-parallel ranks ({placement}, "
                          f"{bundles[0]} each) within {timeout:g} s: {why}. Add nodes (`ray start --address HEAD:PORT` "
                          "on another host), or ask for fewer ranks, or another --ray-placement")


def rank_actor_class():
    """The actor that holds one rank's bundle: the seat (rank 0's, `where` only) or a worker (`run`)."""
    import ray

    @ray.remote
    class RankActor:
        def where(self) -> tuple[str, list[str]]:
            """The node this actor runs on, and the GPUs Ray gave it."""
            return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

        def run(self, fn, *args):
            return fn(*args)

    return RankActor


def started(actors: list, timeout: float) -> list[tuple[str, list[str]]]:
    """Each actor's `where()`, once all have started; an actor that has not within `timeout`
    seconds (its node busy, or its runtime environment still being set up) is an error that says
    where to look, not Ray's bare "Get timed out"."""
    import ray

    try:
        return ray.get([a.where.remote() for a in actors], timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the Ray actors of the tensor-parallel ranks did not start within {timeout:g} s: see "
                           "`ray status`, and the logs of their nodes (/tmp/ray/session_latest/logs)") from None


class RayRanks:
    """The driver's hold on a Ray cluster for one engine: its connection, the placement group of
    its ranks, the seat on rank 0's bundle, and the worker actors. `nodes[r]`: rank r's node id."""

    def __init__(self, size: int, cuda: bool, placement: str, timeout: float, pythonpath: str):
        import ray

        self.size, self.cuda, self.timeout = size, cuda, timeout
        self.group, self.seat, self.actors, self.refs, self.nodes = None, None, [], [], []
        self.owns_connection = connect(pythonpath)
        try:
            self.driver_node = ray.get_runtime_context().get_node_id()
            self.group = place_ranks(size, cuda, placement, self.driver_node, timeout)
            self.seat = self.actor_in_bundle(0)
            [(node, gpus)] = started([self.seat], timeout)
            self.nodes = [node]
            self.driver_device = driver_cuda_device(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) if cuda else "cpu"
            # The address the other ranks reach the driver at: its node's IP, never 127.0.0.1.
            self.host = ray.util.get_node_ip_address()
        except BaseException:
            self.close()
            raise

    def actor_in_bundle(self, rank: int):
        """A new actor that runs inside rank `rank`'s bundle, taking all of its resources."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank)
        return rank_actor_class().options(num_cpus=1, num_gpus=int(self.cuda), scheduling_strategy=strategy).remote()

    def start(self, fn, args_of_rank) -> tuple[list, list]:
        """Start ranks 1..size-1, each running `fn(*args_of_rank(rank))` in its own bundle. Returns
        (the actors, the references of their runs: one resolves when its rank stops)."""
        try:
            self.actors = [self.actor_in_bundle(rank) for rank in range(1, self.size)]
            # Each actor first says where it runs: proof that it started (a runtime environment that
            # fails on a node shows here, not as a rendezvous that waits for the whole timeout).
            self.nodes += [node for node, _ in started(self.actors, self.timeout)]
            self.refs = [a.run.remote(fn, *args_of_rank(rank)) for rank, a in enumerate(self.actors, start=1)]
        except BaseException:
            self.close()
            raise
        return self.actors, self.refs

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Let the workers finish (they were told to stop), kill what is left, remove the placement
        group and wait until Ray has freed it, all within `timeout` seconds; then disconnect if
        this engine connected."""
        import ray

        if not ray.is_initialized():  # disconnected already (by the user): Ray has freed everything
            return
        deadline = time.monotonic() + timeout
        if self.refs:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout / 2)
        for actor in [a for a in [self.seat, *self.actors] if a is not None]:
            ray.kill(actor)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            wait_removed(self.group, deadline)
        self.group, self.seat, self.actors, self.refs = None, None, [], []
        if self.owns_connection and ray.is_initialized():
            ray.shutdown()
        self.owns_connection = False


def wait_removed(group, deadline: float) -> bool:
    """Wait (until the monotonic `deadline`) for Ray to report the group removed: its resources are
    free for the next engine once it does. True if it did."""
    from ray.util.placement_group import placement_group_table

    while placement_group_table(group).get("state") != "REMOVED":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
