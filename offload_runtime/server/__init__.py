"""Serving: an OpenAI-compatible HTTP server over the offloading runtime, with dynamic batching
and Prometheus metrics of the expert cache and the predictor. As vLLM's entrypoints: `app` holds
the routes, `handlers` the handling of each endpoint's request, `schemas` the typed request and
response bodies, `service` the served model and its request checks; `scheduler` decodes
concurrent requests together."""

from offload_runtime.server.app import create_app, run_server
from offload_runtime.server.service import ServeConfig, Service

__all__ = ["ServeConfig", "Service", "create_app", "run_server"]
