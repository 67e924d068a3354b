"""Ray and Serve for a test module: a local Ray (no dashboard, small object store) and Serve's HTTP proxy on a
free loopback port, with the environment this machine kind needs, all undone at the end."""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_on_loopback(num_cpus: int = 2) -> Iterator[int]:
    """Yields the port Serve's proxy listens on (127.0.0.1); ``serve.run`` apps onto it inside the block."""
    saved = {key: os.environ.get(key) for key in RAY_ENV}
    os.environ.update(RAY_ENV)
    import ray
    from ray import serve
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
