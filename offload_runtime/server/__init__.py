"""Serving: an OpenAI-compatible HTTP server over the offloading runtime, with dynamic batching
and Prometheus metrics of the expert cache and the predictor. See `app` for the endpoints and
`scheduler` for how concurrent requests are decoded together."""

from offload_runtime.server.app import ServeConfig, Service, create_app, run_server

__all__ = ["ServeConfig", "Service", "create_app", "run_server"]
