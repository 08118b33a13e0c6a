"""Devices and processes: the client axis over a `jax.sharding.Mesh`.

The client axis (and a sweep's seed axis) is laid over a 1-D mesh named
"clients" with `NamedSharding`. Where copies of a run are stacked in front of
it (a comparison's [seeds, m, ...]), the caller says how many copies axes there
are; what is per-client is decided by type (`FederatedData`, an algorithm's
`client_axes`), never by guessing from shapes. jit places the cross-device
reductions (the per-cluster sums of `segment_average`, the gradient VJP); there
is no hand-written communication. Results do not depend on the device count
(beyond the order of float sums) because every per-client key is fold_in(key,
client id), never a split that depends on the layout.

Past one machine the same program runs under `jax.distributed.initialize`
(JAX's own multi-process runtime): each process builds only its share of the
clients and `jax.make_array_from_process_local_data` assembles the global
arrays; only process 0 writes files.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_sim.data.federated import ClientSource, is_client_source

AXIS = "clients"


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over the first `num_devices` devices (default: all, every process's).

    The axis is `Auto`: JAX's default Explicit axes would reject plain `jit`.
    """
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not isinstance(n, int) or not 1 <= n <= len(devices):
        raise ValueError(
            f"devices must be an integer in [1, {len(devices)}] (the devices JAX sees: "
            f"{jax.default_backend()} x{len(devices)}); got {num_devices!r}."
        )
    return Mesh(np.array(devices[:n]), (AXIS,), axis_types=(AxisType.Auto,))


def client_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_divisible(num_clients: int, mesh: Mesh, what: str = "m (clients)") -> None:
    if num_clients % mesh.size:
        available = jax.device_count()
        allowed = [c for c in range(1, available + 1) if num_clients % c == 0]
        raise ValueError(
            f"{what}={num_clients} must be divisible by the number of devices ({mesh.size}) "
            f"to shard it; choose --devices dividing it (here: "
            f"{', '.join(map(str, allowed))})."
        )


def shard_clients(tree, mesh: Mesh):
    """Places every leaf's leading (client) axis over the mesh."""
    leaves = jax.tree.leaves(tree)
    if leaves:
        check_divisible(leaves[0].shape[0], mesh)
    return jax.device_put(tree, client_sharding(mesh))


def axis_sharding(mesh: Mesh, axis: int) -> NamedSharding:
    """Axis `axis` of an array over the mesh, every other axis whole."""
    return NamedSharding(mesh, P(*([None] * axis), AXIS))


def num_clients(data: ClientSource, copy_axes: int = 0) -> int:
    """The clients of `data` whose leaves carry `copy_axes` leading copies axes (seeds)
    before the client axis: [*copies, m, ...].

    Raises:
      ValueError: `num_examples` is not [*copies, m] (the declared copies axes do not
        match the data).
    """
    if not isinstance(copy_axes, int) or isinstance(copy_axes, bool) or copy_axes < 0:
        raise ValueError(f"copy_axes must be an integer >= 0; got {copy_axes!r}.")
    shape = data.num_examples.shape
    if len(shape) != copy_axes + 1:
        raise ValueError(
            f"the client data's num_examples has shape {tuple(shape)}, but {copy_axes} "
            f"leading copies axes were declared (expected [*copies, m] with "
            f"{copy_axes + 1} axes): declare as many copies axes as the data was stacked "
            "with (a data set per seed: 1; one data set every seed shares: 0).")
    return int(shape[copy_axes])


def input_shardings(inputs, mesh: Mesh, copy_axes: int = 0):
    """Per leaf of an algorithm's inputs: client-sharded inside client data, else replicated.

    Decided by type: a `ClientSource` (FederatedData, ClientViews,
    GeneratedClients) says which of its leaves are per-client (`placement`:
    all of FederatedData's; a view's indices, not its shared base); those
    have the client axis after `copy_axes` leading copies axes (1 for data
    stacked per seed, as a comparison's methods get it). Anything else
    (`ServerData`, plain arrays) is replicated.
    """

    def place(node):
        if is_client_source(node):
            per_client = node.placement()
            if any(jax.tree.leaves(per_client)):
                check_divisible(num_clients(node, copy_axes), mesh,
                                "m (clients)" if copy_axes == 0 else "clients")
            return jax.tree.map(
                lambda p: axis_sharding(mesh, copy_axes) if p else replicated(mesh), per_client)
        return replicated(mesh)

    return jax.tree.map(place, inputs, is_leaf=is_client_source)


def place_inputs(inputs, mesh: Mesh, copy_axes: int = 0):
    """An algorithm's inputs placed by `input_shardings`."""
    return jax.device_put(inputs, input_shardings(inputs, mesh, copy_axes))


def client_data(inputs) -> ClientSource:
    """The (first) client data (a `ClientSource`, e.g. FederatedData) in an algorithm's inputs."""
    found = [n for n in jax.tree.leaves(inputs, is_leaf=is_client_source) if is_client_source(n)]
    if not found:
        raise ValueError("the algorithm's inputs hold no FederatedData.")
    return found[0]


def state_shardings(client_axes, mesh: Mesh):
    """NamedShardings from an algorithm's `client_axes(state)` (-1: replicated)."""

    def spec(axis):
        return replicated(mesh) if axis < 0 else axis_sharding(mesh, axis)

    return jax.tree.map(spec, client_axes)


def shard_state(state, client_axes, mesh: Mesh):
    """State leaves placed by the algorithm's declared client axes."""
    return jax.device_put(state, state_shardings(client_axes, mesh))


def to_host(x) -> np.ndarray:
    """A numpy copy of x, gathering it from other processes when it spans several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def tree_to_host(tree):
    """`to_host` of every leaf; leaves held by this process come in one batched transfer
    (`jax.device_get`), not one blocking copy each."""
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(to_host, tree)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Starts JAX's multi-process runtime.

    Arguments left None are read from FEDJAX_SIM_COORDINATOR,
    FEDJAX_SIM_NUM_PROCESSES and FEDJAX_SIM_PROCESS_ID, and failing those
    JAX's own cluster auto-detection (SLURM, Open MPI, Cloud TPU) takes over.
    On CPU the cross-process collectives use gloo.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("FEDJAX_SIM_COORDINATOR") or None
    num_processes = _count("--num-processes", num_processes, "FEDJAX_SIM_NUM_PROCESSES", 1)
    process_id = _count("--process-id", process_id, "FEDJAX_SIM_PROCESS_ID", 0)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(
            f"--process-id (FEDJAX_SIM_PROCESS_ID) must be in [0, {num_processes}) for "
            f"--num-processes={num_processes}; got {process_id}."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    except ValueError as err:  # JAX found no cluster to read the missing values from
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(
            "--distributed needs --coordinator HOST:PORT, --num-processes and --process-id "
            "(or FEDJAX_SIM_COORDINATOR, FEDJAX_SIM_NUM_PROCESSES, FEDJAX_SIM_PROCESS_ID) "
            f"where no SLURM/Open MPI/Cloud TPU cluster is detected; JAX said: {first}"
        ) from None


def _count(flag: str, value, variable: str, minimum: int) -> int | None:
    """An integer >= minimum from the argument or, when it is None, the environment variable."""
    source = flag
    if value is None and os.environ.get(variable, "").strip():
        value, source = os.environ[variable].strip(), f"{variable} (environment)"
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{source} must be an integer >= {minimum}; got {value!r}.") from None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < minimum):
        raise ValueError(f"{source} must be an integer >= {minimum}; got {value!r}.")
    return value


def is_primary() -> bool:
    """True on the process that writes outputs (process 0)."""
    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Waits until every process has reached the barrier `name` (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_client_ids(num_clients: int, mesh: Mesh) -> np.ndarray:
    """The client ids whose rows live on this process's devices, in global order."""
    check_divisible(num_clients, mesh)
    index_map = client_sharding(mesh).addressable_devices_indices_map((num_clients,))
    ids = sorted({i for idx in index_map.values() for i in range(num_clients)[idx[0]]})
    return np.asarray(ids, np.int64)


def assemble_clients(local_tree, num_clients: int, mesh: Mesh):
    """Global client-sharded arrays from this process's rows (`process_client_ids` order)."""
    sharding = client_sharding(mesh)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(
            sharding, np.asarray(a), (num_clients,) + a.shape[1:]
        ),
        local_tree,
    )
