"""RayExecutor: one Ray actor per rank, in a placement group, on one machine or several.

The actors wrap the same ``Worker`` as the mp executor's processes (``worker.py``): each joins
the tensor-parallel group (the master is rank 0's node, on a port free there), builds its runner
and answers the same calls, encoded by the same wire codec. A call is encoded once and put in
Ray's object store once; every actor reads the same object, so the ranks see the same bytes.

Ray is started on demand (a local instance owned by this executor, stopped with it) unless this
process is already connected, or ``RAY_ADDRESS`` names a cluster (``ray start --head`` on one
machine, ``ray start --address=HEAD:6379`` on the others): then the actors go wherever the
placement group finds room, one bundle per rank (a GPU each on CUDA, a CPU each otherwise), packed
on as few nodes as possible.

A dead actor fails its pending call with RayActorError at once; waiting on the ranks' calls
watches them all, so a rank that dies while another waits in a collective wakes the engine with
EngineDeadError naming it, never a hang.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm import envs
from pagedllm.distributed.launch import DistributedInit, get_open_port
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.executor.abstract import RankGroupExecutor, RunnerFactory
from pagedllm.executor.ipc import error_info, remote_error
from pagedllm.executor.wire import Codec
from pagedllm.executor.worker import Worker

logger = logging.getLogger(__name__)

# A local Ray started here keeps its shared-memory object store small: only calls and their
# replies (kilobytes) pass through it, never weights or activations.
_LOCAL_OBJECT_STORE_BYTES = 128 << 20


class RayWorkerWrapper:
    """The body of a rank's Ray actor (``ray.remote`` is applied at run time, so importing this
    module needs no Ray)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.codec = Codec()
        self.worker: Worker | None = None

    def node_ip_and_pid(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def open_port(self) -> int:
        import ray

        return get_open_port(ray.util.get_node_ip_address())

    def start(self, runner_factory: RunnerFactory, distributed: DistributedInit | None) -> list:
        """["ready", pid] or ["error", error_info]: as the mp worker reports its start."""
        try:
            self.worker = Worker(self.rank, runner_factory, distributed)
        except BaseException as exc:  # noqa: BLE001 - reported, re-raised by the executor
            return ["error", error_info(exc)]
        return ["ready", os.getpid()]

    def execute(self, message: bytes) -> bytes:
        method, args = self.codec.decode(message)
        assert self.worker is not None, "the rank was not started"
        return self.worker.reply(self.codec, method, args)

    def ping(self) -> bool:
        return True


class RayExecutor(RankGroupExecutor):
    def __init__(self, runner_factory: RunnerFactory, world_size: int = 1, *,
                 device: str = "auto", startup_timeout_s: float = 300.0,
                 init_timeout_s: float = 120.0) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ValidationError("distributed_executor_backend='ray' needs Ray: pip install "
                                  "'pagedllm[ray]' (or 'ray>=2.40')",
                                  "distributed_executor_backend") from exc
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.world_size = world_size
        self._codec = Codec()
        self._failure: str | None = None
        self._is_shut_down = False
        self._actors: list[Any] = []
        self._placement_group = None
        self._owns_ray = False
        self.worker_pids: list[int] = []
        self._start_ray()
        try:
            gpu = device.startswith("cuda") or (
                device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
            bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
            self._placement_group = placement_group([dict(bundle) for _ in range(world_size)],
                                                    strategy="PACK")
            ready, _ = ray.wait([self._placement_group.ready()], timeout=startup_timeout_s)
            if not ready:
                raise EngineDeadError(
                    f"the Ray cluster has no room for {world_size} workers of {bundle} each within "
                    f"{startup_timeout_s:.0f} s (it has {ray.available_resources()} available); "
                    f"lower tensor_parallel_size or add nodes")
            actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                                   max_task_retries=0)(RayWorkerWrapper)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(self._placement_group,
                                                            placement_group_bundle_index=rank)
                self._actors.append(actor_cls.options(
                    scheduling_strategy=strategy).remote(rank))
            self._start_workers(runner_factory, device, init_timeout_s, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start_ray(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        address = envs.ray_address()
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(include_dashboard=False, object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
                     log_to_driver=True)
            self._owns_ray = True
        logger.info("Ray: %s", "started a local instance" if self._owns_ray else f"joined {address}")

    def _start_workers(self, runner_factory: RunnerFactory, device: str, init_timeout_s: float,
                       startup_timeout_s: float) -> None:
        placed = self._gather([a.node_ip_and_pid.remote() for a in self._actors], "start",
                              startup_timeout_s)
        ips = [ip for ip, _ in placed]
        self.worker_pids = [pid for _, pid in placed]
        distributed = [None] * self.world_size
        if self.world_size > 1:
            port = self._gather([self._actors[0].open_port.remote()], "start", startup_timeout_s)[0]
            distributed = [DistributedInit(rank, self.world_size, ips[0], port, device,
                                           local_rank=ips[:rank].count(ips[rank]),
                                           local_world_size=ips.count(ips[rank]),
                                           timeout_s=init_timeout_s)
                           for rank in range(self.world_size)]
        replies = self._gather([a.start.remote(runner_factory, d)
                                for a, d in zip(self._actors, distributed)], "start",
                               startup_timeout_s)
        for rank, (kind, payload) in enumerate(replies):
            if kind == "error":
                raise remote_error(payload, f"worker rank {rank} failed to start")

    # -- the Executor interface -------------------------------------------------------------
    def _check_ranks(self) -> None:
        self._gather([a.ping.remote() for a in self._actors], "a health check", 30.0)

    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._actors.clear()
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement_group)
            except Exception:  # noqa: BLE001 - the cluster is going away too
                pass
            self._placement_group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()  # the local Ray this executor started: its processes go with it

    # -- the calls --------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> list[Any]:
        if self._is_shut_down:
            raise EngineDeadError("the executor was shut down")
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        message = self._ray.put(self._codec.encode([method, list(args)]))
        replies = [self._codec.decode(r) for r in self._gather(
            [a.execute.remote(message) for a in self._actors], method)]
        for rank, (kind, payload) in enumerate(replies):
            if kind == "error":
                exc = remote_error(payload, f"worker rank {rank} failed in {method}")
                self._failure = f"worker rank {rank} failed in {method}: {exc}"
                raise exc
        return [payload for _, payload in replies]

    def _gather(self, refs: list, what: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's result, rank order; EngineDeadError as soon as any rank's actor dies."""
        ray = self._ray
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                self._failure = f"the Ray workers did not answer {what} within {timeout_s:.0f} s"
                raise EngineDeadError(self._failure)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    rank = refs.index(ref)
                    pid = self.worker_pids[rank] if rank < len(self.worker_pids) else "?"
                    self._failure = (f"worker rank {rank} (Ray actor, pid {pid}) died during "
                                     f"{what}; the engine cannot continue (restart it): "
                                     f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                    raise EngineDeadError(self._failure) from exc
        return ray.get(refs)
