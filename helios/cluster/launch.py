"""`helios cluster serve|scale`: start (or join) Ray, deploy the frontend and the engine
replicas as one Ray Serve application, and operate it.

Ray Serve's own HTTP proxy is not started: the frontend deployment listens itself (pinned to
the node that ran the command), so the endpoint is exactly `helios serve`'s.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.config import RequestRouterConfig

from helios.cluster.frontend import Frontend
from helios.cluster.replica import EngineReplica
from helios.cluster.router import PrefixAffinityRouter
from helios.cluster.spec import APP_NAME, ENGINES, FRONTEND, ClusterSpec
from helios.transport.config import ServerConfig

HEALTH_CHECK_PERIOD_S = 2.0
ROUTING_STATS_PERIOD_S = 0.5
OBJECT_STORE_BYTES = 256 << 20  # requests and events are small; Ray's default takes 30% of memory


def build(spec: ClusterSpec, node_resource: str) -> Any:
    """The Serve application: N engine replicas under the affinity router, one frontend."""
    settings = spec.settings
    engines = serve.deployment(EngineReplica).options(
        name=ENGINES,
        num_replicas=spec.replicas,
        ray_actor_options={"num_cpus": spec.replica_threads},
        # The frontend admits and queues (its [server] limits); a replica never refuses work.
        max_ongoing_requests=1 << 16,
        max_queued_requests=-1,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__name__}",
            request_router_kwargs={"policy": spec.policy, "capacity": spec.replica_capacity},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        ),
    )
    frontend = serve.deployment(Frontend).options(
        name=FRONTEND,
        num_replicas=1,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 0, "resources": {node_resource: 0.001}},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    return frontend.bind(spec, engines.bind(spec))


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run` / KubeRay entry (`import_path: helios.cluster.launch:app_builder`): args are
    `core` (a path every node sees), `replicas`, `threads`, `host`, `port`, `router`, `config`
    (a [server] TOML file), `host_store`, and `frontend_resource`, a custom resource only the
    node that should listen declares (default `helios_frontend`; docs/cluster.md)."""
    settings = ServerConfig.load(Path(args["config"])) if args.get("config") else ServerConfig()
    settings.host = str(args.get("host", "0.0.0.0"))
    settings.port = int(args.get("port", settings.port))
    if args.get("host_store"):
        settings.host_store_dir = str(args["host_store"])
    spec = ClusterSpec(
        core=Path(args["core"]),
        replicas=int(args.get("replicas", 2)),
        threads=int(args["threads"]) if args.get("threads") else None,
        policy=str(args.get("router", "affinity")),
        settings=settings,
    )
    return build(spec, str(args.get("frontend_resource", "helios_frontend")))


def connect(address: str | None, num_cpus: int | None = None) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry unless the operator opts in
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )


def deploy(spec: ClusterSpec) -> str:
    """Deploy (or update) the application; returns the frontend's bound address."""
    node_resource = f"node:{ray.util.get_node_ip_address()}"
    serve.start(http_options={"location": "NoServer"})
    handle = serve.run(build(spec, node_resource), name=APP_NAME, route_prefix=None, external_scaler_enabled=True)
    return handle.address.remote().result()


def serve_forever(spec: ClusterSpec, ready: Callable[[str], None]) -> None:
    """Serve until SIGTERM/SIGINT, then drain the frontend and stop the application."""
    connect(spec.address, None if spec.address else max(os.cpu_count() or 1, spec.replicas * spec.replica_threads))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        ready(deploy(spec))
        while not stop.wait(1.0):
            pass
        serve.get_deployment_handle(FRONTEND, APP_NAME).drain.remote().result()
    finally:
        serve.delete(APP_NAME)
        if not spec.address:
            serve.shutdown()
            ray.shutdown()


def scale(address: str, replicas: int) -> None:
    """Set the engine replica count of the running cluster: new replicas join the router; removed
    ones drain (Ray waits for their in-flight requests, up to the drain deadline) and stop."""
    connect(address)
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(ENGINES, APP_NAME), replicas))
