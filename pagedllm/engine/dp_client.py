"""DPEngineCoreClient: data-parallel replicas, N engine cores behind one front end.

``--data-parallel-size N`` starts N engine core processes, each a whole model with its own
scheduler and KV cache (``MPEngineCoreClient`` each), and this client stands in for one core
behind EngineCore's methods, so ``LLMEngine`` and ``AsyncLLM`` do not change: one tokenizer,
one detokenizer and one HTTP server in front, as vLLM's DP load-balancing client.

* ``add_request`` picks the replica (``dp_router.DPRouter``: least loaded, a shared prefix
  preferred on the replica that holds it) and remembers it for every sequence of the request.
* ``abort_requests`` / ``finish_requests`` go to the replica that owns each sequence.
* ``step()`` returns the next step outputs any replica pushed (round robin over the replicas
  with news, so a fast one does not starve the others' streams), waiting on all of their
  sockets and processes at once while any has work; a replica's stats update the router.
* Seeds: every replica gets the same config (the engine seed included), as vLLM's DP ranks do;
  a seeded request samples from its own generator, so its output does not depend on where it
  ran. Each replica gets ``os.cpu_count() // N`` threads (``OMP_NUM_THREADS``, unless the
  caller set it) so that N replicas do not oversubscribe the cores. Replicas share the devices
  they see: on one GPU, size each KV cache (``gpu_memory_utilization``) for N.
* Health: any replica that dies kills the engine (its error names the replica; ``on_dead``
  callbacks fire once: AsyncLLM fails every stream, /health 503). ``shutdown`` stops and reaps
  every replica, each of which reaps its own workers.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

import zmq

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.core_client import MPEngineCoreClient
from pagedllm.engine.dp_router import DPRouter
from pagedllm.engine.parallel_sampling import sample_request_ids
from pagedllm.errors import EngineDeadError
from pagedllm.lora.request import LoRARequest
from pagedllm.runner.base import Runner

_POLL_MS = 100  # a wait looks at shutdown this often (a socket or a process ending wakes it)
logger = logging.getLogger("pagedllm")


class DPEngineCoreClient:
    def __init__(self, config: EngineConfig, max_model_len: int, runner: Runner | None = None,
                 startup_timeout_s: float = 300.0) -> None:
        num_replicas = config.parallel_config.data_parallel_size
        self.num_replicas = num_replicas
        self.router = DPRouter(num_replicas, config.cache_config.block_size,
                               max(1, config.scheduler_config.max_num_seqs // 2))
        self.on_dead: list[Callable[[EngineDeadError], None]] = []
        self._dead: EngineDeadError | None = None
        self._death_lock = threading.Lock()
        self._next = 0  # where step()'s round robin starts
        # step() waits on every replica's output socket at once, outside the replicas' own locks;
        # shutdown() closes those sockets only once no such wait runs (libzmq sockets are not
        # thread-safe: closing one under another thread's poll can abort the process).
        self._poll_lock = threading.Lock()
        self._closing = False
        self.clients = self._start(config, max_model_len, runner, startup_timeout_s)
        self._poller = zmq.Poller()
        for i, client in enumerate(self.clients):
            client.on_dead.append(lambda error, i=i: self._replica_died(i, error))
            for handle in client.poll_handles:
                self._poller.register(handle, zmq.POLLIN)
        self.pids = [client.pid for client in self.clients]
        self.pid = ", ".join(map(str, self.pids))  # for messages naming "the" core process
        # Every replica has the same config, so the same KV cache: what one request may use.
        self.num_blocks = min(client.num_blocks for client in self.clients)

    @staticmethod
    def _start(config: EngineConfig, max_model_len: int, runner: Runner | None,
               startup_timeout_s: float) -> list[MPEngineCoreClient]:
        """Start the replicas side by side (each loads its model: minutes for a large one);
        if any fails, the others are stopped and the first error raised."""
        n = config.parallel_config.data_parallel_size
        env: dict[str, str] = {}
        if envs.omp_num_threads() is None:  # on a GPU too: the host side needs few
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        clients: list[MPEngineCoreClient | None] = [None] * n
        errors: list[BaseException] = []

        def start(i: int) -> None:
            try:
                clients[i] = MPEngineCoreClient(config, max_model_len, runner, startup_timeout_s,
                                                engine_index=i, process_env=env)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(i,), name=f"pagedllm-dp-start-{i}")
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            for client in clients:
                if client is not None:
                    client.shutdown()
            raise errors[0]
        return [c for c in clients if c is not None]

    # -- EngineCore's methods ----------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        prefix_hash = self.router.prefix_hash(request.prompt_token_ids, request.cache_salt)
        replica = self.router.route(prefix_hash)
        self.clients[replica].add_request(request)  # a ValidationError: nothing recorded
        params = request.sampling_params
        seq_ids = ([request.request_id] if params is None  # a beam search: one id at the core
                   else sample_request_ids(request.request_id, params.n))
        self.router.assign(replica, seq_ids, prefix_hash, len(request.prompt_token_ids))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._check_alive()
        for replica, ids in self.router.release(request_ids).items():
            self.clients[replica].abort_requests(ids)

    def finish_requests(self, request_ids: Iterable[str], stop_reason: str) -> None:
        """Sequences the front end stopped (a stop string): the core reports no finish for
        them, so they are released here."""
        self._check_alive()
        for replica, ids in self.router.release(request_ids).items():
            self.clients[replica].finish_requests(ids, stop_reason)

    def reset_prefix_cache(self) -> bool:
        self._check_alive()
        return all([client.reset_prefix_cache() for client in self.clients])

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self._check_alive()
        return all([client.add_lora(lora_request) for client in self.clients])

    def remove_lora(self, lora_int_id: int) -> bool:
        self._check_alive()
        return any([client.remove_lora(lora_int_id) for client in self.clients])

    def list_loras(self) -> list[int]:
        return self.clients[0].list_loras()

    def get_metrics(self) -> dict[str, float]:
        """The replicas' metrics added up (usage fractions averaged), as one engine's."""
        per_engine = self.get_metrics_per_engine()
        total: dict[str, float] = {}
        for metrics in per_engine:
            for key, value in metrics.items():
                total[key] = total.get(key, 0.0) + value
        for key in total:
            if key.endswith("_perc"):
                total[key] /= len(per_engine)
        return total

    def get_metrics_per_engine(self) -> list[dict[str, float]]:
        """Each replica's own metrics (index = the ``engine`` label), with how many requests the
        router sent it, and how many of those followed a prefix to it."""
        self._check_alive()
        out = []
        for i, client in enumerate(self.clients):
            metrics = client.get_metrics()
            metrics["pagedllm:dp_requests_routed"] = self.router.num_routed[i]
            metrics["pagedllm:dp_requests_routed_by_prefix"] = self.router.num_prefix_routed[i]
            metrics["pagedllm:prompt_tokens"] = self.router.num_prompt_tokens[i]
            out.append(metrics)
        return out

    def engine_index_of(self, request_id: str) -> int | None:
        """The replica of an open request (its own id, or its first sample's when n > 1)."""
        replica = self.router.owner_of(request_id)
        return replica if replica is not None else self.router.owner_of(f"0_{request_id}")

    def has_unfinished_requests(self) -> bool:
        return any(client.has_unfinished_requests() for client in self.clients)

    def step(self) -> EngineCoreOutputs | None:
        """The next step outputs of any replica (waiting for one while any has work), or None
        at once when no replica has anything pending."""
        n = self.num_replicas
        while True:
            self._check_alive()
            busy = False
            for k in range(n):
                replica = (self._next + k) % n
                client = self.clients[replica]
                try:
                    outputs = client.try_step()
                except EngineDeadError:
                    self._check_alive()  # the replica's death, named as the engine's
                    raise
                if outputs is not None:
                    self._next = replica + 1
                    outputs.engine_index = replica
                    self._observe(replica, outputs)
                    return outputs
                busy = busy or client.has_unfinished_requests()
            if not busy:
                return None
            with self._poll_lock:
                if self._closing:
                    raise EngineDeadError("the engine was shut down")
                self._poller.poll(_POLL_MS)

    def _observe(self, replica: int, outputs: EngineCoreOutputs) -> None:
        """A replica's step: its load for the router, and the sequences that ended there."""
        self.router.update_stats(replica, outputs.scheduler_stats.num_running_reqs)
        if outputs.finished:
            self.router.release(outputs.finished)
        if outputs.finished_beams:
            self.router.release(outputs.finished_beams)

    def shutdown(self) -> None:
        """Stop and reap every replica (side by side: each may take seconds). Idempotent."""
        self._closing = True
        with self._poll_lock:  # a step's wait ends within _POLL_MS, then sees _closing
            threads = [threading.Thread(target=client.shutdown, name=f"pagedllm-dp-stop-{i}")
                       for i, client in enumerate(self.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    # -- a dead replica ----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _replica_died(self, replica: int, error: EngineDeadError) -> None:
        """One replica died (its monitor thread, or a call that saw it): the engine is dead."""
        with self._death_lock:
            if self._dead is not None:
                return
            self._dead = EngineDeadError(f"data-parallel replica {replica} of {self.num_replicas} "
                                         f"died: {error}")
            self._dead.__cause__ = error.__cause__
        for callback in self.on_dead:
            try:
                callback(self._dead)
            except Exception:  # noqa: BLE001 - one callback's failure does not hide the death
                logger.exception("an engine core death callback failed")
